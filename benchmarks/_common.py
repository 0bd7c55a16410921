"""Shared pieces of the benchmark scripts: model shapes, random-weight checkpoints, timing helpers.

Not a benchmark itself. The scripts in this folder import it as ``_common`` (``python benchmarks/x.py`` puts
this folder first on ``sys.path``).
"""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path

import torch

from kvexplore.formats.loading import DTYPES  # noqa: F401  (re-exported for the scripts)

# name -> Llama config fields. "24M" is the llama2.c stories shape with untied embeddings (~24.4M parameters);
# "135M" is SmolLM2-135M (GQA 9:3, tied embeddings, rope_theta 1e5).
SHAPES: dict[str, dict] = {
    "24M": dict(hidden_size=288, num_hidden_layers=6, num_attention_heads=6, num_key_value_heads=6,
                intermediate_size=768, vocab_size=32000, tie_word_embeddings=False, rope_theta=10000.0),
    "135M": dict(hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                 intermediate_size=1536, vocab_size=49152, tie_word_embeddings=True, rope_theta=100000.0),
}

# real weights, fetched once as kvexplore named models: benchmark name -> (named model, vocabulary size)
REAL_MODELS = {"smollm2": ("smollm2-135m", 49152)}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def build_checkpoint(shape: str, folder: Path, seed: int = 0, max_positions: int = 4096,
                     initializer_range: float = 0.02) -> torch.nn.Module:
    """Random-weight ``LlamaForCausalLM`` of ``shape`` saved (safetensors, float32) to ``folder``.

    The config has no bos/eos/pad token, so ``generate`` cannot stop early on an end-of-sequence token.
    Returns the float32 transformers model (eval mode) on the CPU.
    """
    import transformers

    transformers.utils.logging.disable_progress_bar()
    s = dict(SHAPES[shape])
    theta = s.pop("rope_theta")
    config = transformers.LlamaConfig(
        **s, max_position_embeddings=max_positions, initializer_range=initializer_range, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": theta},
        bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config).float().eval()
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    return model


def load_hf(folder: Path, dtype: torch.dtype, device: torch.device | str) -> torch.nn.Module:
    """The transformers model saved in ``folder``, in ``dtype`` on ``device``, eval mode, default attention."""
    import transformers

    transformers.utils.logging.disable_progress_bar()
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
    return model.to(device).eval()


# small checkpoints for parity checks: name -> (transformers config class, extra config fields)
PARITY_CASES: dict[str, tuple[str, dict]] = {
    "llama-gqa": ("LlamaConfig", dict(hidden_size=256, num_hidden_layers=3, num_attention_heads=8,
                                      num_key_value_heads=2, intermediate_size=512, vocab_size=1000,
                                      tie_word_embeddings=False)),
    "qwen2-qkv-bias": ("Qwen2Config", dict(hidden_size=256, num_hidden_layers=3, num_attention_heads=8,
                                           num_key_value_heads=4, intermediate_size=512, vocab_size=1000,
                                           tie_word_embeddings=False)),
    "llama-tied": ("LlamaConfig", dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                                       num_key_value_heads=4, intermediate_size=384, vocab_size=1000,
                                       tie_word_embeddings=True)),
    "mistral-window16": ("MistralConfig", dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                                               num_key_value_heads=2, intermediate_size=256, vocab_size=1000,
                                               tie_word_embeddings=False, sliding_window=16)),
}


def build_parity_checkpoint(case: str, folder: Path, seed: int = 0, init_range: float = 0.1) -> None:
    """Save a random-weight checkpoint of ``PARITY_CASES[case]`` to ``folder``. Norm weights and biases get
    random perturbations (they start at 1 and 0), so a mistake in either cannot go unnoticed."""
    import transformers

    transformers.utils.logging.disable_progress_bar()
    cls_name, fields = PARITY_CASES[case]
    config = getattr(transformers, cls_name)(
        **fields, max_position_embeddings=1024, initializer_range=init_range, rms_norm_eps=1e-5,
        bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)


def sync(device: torch.device | str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def now(device: torch.device | str) -> float:
    sync(device)
    return time.perf_counter()


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def spread(xs: list[float]) -> str:
    """``min..max`` of a list of seconds, in milliseconds."""
    return f"{min(xs) * 1e3:.1f}..{max(xs) * 1e3:.1f} ms" if xs else "-"


def prompt_ids(n: int, vocab: int, seed: int = 1) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=g).tolist()


# -- load from other processes (this machine is shared; a busy neighbour skews CPU timings) --------------
def _proc_ticks() -> tuple[int, int] | None:
    """(busy ticks of the whole machine, ticks this process has used), or None where /proc is missing."""
    try:
        with open("/proc/stat") as f:
            parts = [int(x) for x in f.readline().split()[1:]]
        busy = sum(parts[:8]) - parts[3] - parts[4]  # user nice system [idle iowait] irq softirq steal
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return busy, int(fields[11]) + int(fields[12])  # utime + stime, all threads
    except (OSError, ValueError, IndexError):
        return None


def spare_cores() -> float:
    """Cores nobody in this process should need: ``cpu_count - torch.get_num_threads()`` (>= 0)."""
    return max(0.0, float((os.cpu_count() or 1) - torch.get_num_threads()))


class OtherLoad:
    """Average number of CPU cores other processes kept busy between ``start()`` and ``stop()`` (Linux).
    Load that fits on the cores this process's threads leave free does not count as a disturbance."""

    def __init__(self) -> None:
        self.samples: list[float] = []
        self._t0 = self._ticks0 = None

    def start(self) -> None:
        self._t0, self._ticks0 = time.perf_counter(), _proc_ticks()

    def stop(self) -> float | None:
        end, ticks = time.perf_counter(), _proc_ticks()
        if self._ticks0 is None or ticks is None:
            return None
        hz = os.sysconf("SC_CLK_TCK")
        other = ((ticks[0] - self._ticks0[0]) - (ticks[1] - self._ticks0[1])) / hz
        cores = max(0.0, other / max(end - self._t0, 1e-9))
        self.samples.append(cores)
        return cores

    def summary(self) -> str:
        if not self.samples:
            return "other-process load: unknown (no /proc)"
        return (f"other-process load during timed runs: mean {sum(self.samples) / len(self.samples):.2f} cores, "
                f"max {max(self.samples):.2f} cores (of {os.cpu_count()})")

    @property
    def busy(self) -> bool:
        return bool(self.samples) and max(self.samples) > spare_cores() + 0.25


def wait_quiet(max_wait_s: float, threshold: float = 0.2, window_s: float = 0.5) -> float:
    """Sleep until other processes use under ``threshold`` cores (beyond the spare ones) over ``window_s``, at
    most ``max_wait_s``; returns seconds waited. A no-op where /proc is missing or ``max_wait_s`` <= 0."""
    threshold += spare_cores()
    waited = 0.0
    probe = OtherLoad()
    while waited < max_wait_s:
        probe.start()
        time.sleep(window_s)
        load = probe.stop()
        if load is None or load < threshold:
            break
        waited += window_s
    return waited


def passage_arguments(ap, context: int = 1000, continuation: int = 64, threads: int = 2) -> None:
    """The options of a script that scores a continuation of kvexplore's Moby-Dick chapter: ``--model``,
    ``--context``, ``--continuation``, ``--threads``."""
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--context", type=int, default=context)
    ap.add_argument("--continuation", type=int, default=continuation)
    ap.add_argument("--threads", type=int, default=threads)


def outside_env() -> dict[str, str]:
    """This process's environment without what ties Python to the project's venv (for a venv of another tool)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    env["TRANSFORMERS_OFFLINE"] = env["HF_HUB_OFFLINE"] = "1"
    return env


def outside_venv(folder: Path, probe: str, installs: list[list[str]], env: dict[str, str] | None = None) -> Path:
    """The python of a venv of its own in ``folder`` (a reference tool outside kvexplore's dependencies), built on
    first use: ``pip install`` of each of ``installs`` in turn; reused while ``probe`` (Python code) runs in it."""
    import subprocess
    import sys

    python = folder / "bin" / "python"
    env = env or outside_env()
    if python.exists() and subprocess.run([str(python), "-c", probe], capture_output=True, env=env).returncode == 0:
        return python
    print(f"building the venv {folder} (once)", flush=True)
    steps = [[sys.executable, "-m", "venv", str(folder)]] + [[str(python), "-m", "pip", "install", "-q", *i]
                                                             for i in installs]
    for cmd in steps:
        print("  $ " + " ".join(cmd), flush=True)
        subprocess.run(cmd, check=True, env=env)
    return python
