"""Random-weight Hugging Face checkpoints with a sentencepiece tokenizer trained at test time."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import sentencepiece as spm
import torch

TEXT = """The cache keeps the keys and values of every token the model has already seen.
Each new token reads all of them, so nothing has to be computed twice.
A pre-allocated cache reserves its memory once and writes every new key in place.
A concatenating cache allocates a larger tensor and copies the old keys at every step.
Without a cache the model runs the whole sequence again for each token it produces.
Call me Ishmael. Some years ago, never mind how long precisely, having little or no money in my purse,
and nothing particular to interest me on shore, I thought I would sail about a little and see the watery part
of the world. It is a way I have of driving off the spleen and regulating the circulation.
Whenever I find myself growing grim about the mouth; whenever it is a damp, drizzly November in my soul;
then, I account it high time to get to sea as soon as I can. There now is your insular city of the Manhattoes,
belted round by wharves as Indian isles by coral reefs; commerce surrounds it with her surf.
Numbers such as 12, 345 and 6789 appear too, with punctuation: commas, colons; dashes - and quotes "like this".
"""

SP_VOCAB = 320


def train_sentencepiece(path: Path, vocab_size: int = SP_VOCAB) -> int:
    """Train a small BPE sentencepiece model on TEXT, write it to ``path``; return its vocabulary size."""
    lines = [line for line in TEXT.splitlines() if line.strip()] * 4
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_writer=buf, vocab_size=vocab_size, model_type="bpe",
        byte_fallback=True, bos_id=1, eos_id=2, unk_id=0, pad_id=-1, hard_vocab_limit=False,
        normalization_rule_name="identity", remove_extra_whitespaces=False,  # as Llama's tokenizer.model
        minloglevel=2,
    )
    path.write_bytes(buf.getvalue())
    sp = spm.SentencePieceProcessor(model_file=str(path))
    return sp.get_piece_size()


def architectures() -> dict[str, tuple[str, str, dict]]:
    """Short name -> (transformers config class name, model class name, the small config's keys), for every
    architecture in kvexplore's registry (each family module declares its transformers classes and example)."""
    from kvexplore.models.architectures import registered

    return {a.name: (*a.transformers, dict(a.example)) for a in registered() if a.transformers[0]}


# the architectures registered when the tests start (a test that registers a toy adds to architectures())
ARCHITECTURES = architectures()


def make_checkpoint(folder: Path, arch: str = "llama", *, vocab_size: int | None = None, hidden: int = 64,
                    layers: int | None = None, heads: int = 4, kv_heads: int = 2, ffn: int = 128,
                    head_dim: int | None = None, tied: bool = False, rope: dict | None = None,
                    shard_bytes: str | None = None, init_range: float = 0.2, seed: int = 0, tokenizer: bool = True,
                    **extra) -> torch.nn.Module:
    """Save a random-weight transformers model (safetensors) + sentencepiece tokenizer to ``folder``.

    The config starts from the architecture's small example (its family module's ``example``); ``layers``
    defaults to the example's layer count, else 2. Returns the transformers model in float32 eval mode, the
    reference the tests compare against.
    """
    import transformers

    folder.mkdir(parents=True, exist_ok=True)
    sp_size = train_sentencepiece(folder / "tokenizer.model") if tokenizer else 0
    cfg_cls, model_cls, defaults = architectures()[arch]
    kwargs = dict(vocab_size=vocab_size or max(sp_size, 300), hidden_size=hidden, intermediate_size=ffn,
                  num_hidden_layers=2, num_attention_heads=heads, num_key_value_heads=kv_heads,
                  max_position_embeddings=512, tie_word_embeddings=tied, initializer_range=init_range,
                  bos_token_id=1, eos_token_id=2, rms_norm_eps=1e-5)
    kwargs.update(defaults, **extra)
    if layers is not None:
        kwargs["num_hidden_layers"] = layers
    if head_dim is not None:
        kwargs["head_dim"] = head_dim
    if rope is not None:
        kwargs["rope_parameters"] = rope
    config = getattr(transformers, cfg_cls)(**kwargs)
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).float().eval()
    with torch.no_grad():  # RMSNorm weights start at 1; perturb them so a wrong norm cannot pass
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(("bias", "sinks")):
                p.add_(torch.randn_like(p) * (1.0 if name.endswith("sinks") else 0.1))
        for name, b in model.named_buffers():
            if name.endswith("layer_scalar"):  # Gemma 4: a stored scalar per layer, 1 at init
                b.uniform_(0.7, 1.3)
            if name.endswith("e_score_correction_bias"):  # DeepSeek: the router's choice bias, 0 at init
                b.copy_(torch.randn_like(b) * 0.1)
    save = {"safe_serialization": True} if "safe_serialization" in model.save_pretrained.__code__.co_varnames else {}
    model.save_pretrained(folder, max_shard_size=shard_bytes or "10GB", **save)
    if tokenizer:
        (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>",
                                                                  "add_bos_token": True}))
    return model


def greedy_tokens_match(model, ref, kinds=("preallocated", "none"), n=64) -> None:
    """Assert that ``model`` with each cache kind generates transformers' ``n`` greedy tokens after one prompt."""
    import kvexplore

    prompt = [model.tokenizer.bos_id, *model.tokenizer.encode("Call me Ishmael. Some years ago")]
    ref.generation_config.eos_token_id = None  # exactly n tokens, as kvexplore generates below
    with torch.no_grad():
        out = ref.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, pad_token_id=0)
    want = (out.sequences if hasattr(out, "sequences") else out)[0, len(prompt):].tolist()
    assert len(want) == n
    for kind in kinds:
        gen = kvexplore.Generator(model, kvexplore.make_cache(kind, model, 2 * n))
        gen.prefill(prompt)
        gen.run(n - 1, stop_at_eos=False)
        assert gen.generated_tokens == want, kind


@contextlib.contextmanager
def one_gguf_reader(path: Path):
    """While inside, every read-only ``gguf.GGUFReader`` of ``path`` is one reader, parsed once. transformers opens a
    GGUF file three or four times to build its tokenizer and model (the tokenizer, the config, the quantizer's
    view, the weights), and gguf's reader parses the whole vocabulary's arrays each time: 5 s of CPU for SmolLM2's
    49k tokens, 20 s for Gemma 3's 262k. The one reader reads the file into memory instead of mapping it (its
    parse slices the data a million times, and a memory map's slicing runs in Python: 21 s of Gemma 3's 56 s
    reference, about 2 s in memory); it is read-only, so what transformers reads from it is unchanged. Any other
    file reads as before."""
    import types

    import gguf
    import numpy as np
    from gguf import gguf_reader

    real, target, shared = gguf.GGUFReader, Path(path).resolve(), []

    def in_memory(file, mode="r"):
        return np.fromfile(file, dtype=np.uint8)

    def reader(file, mode="r"):
        if mode != "r" or Path(file).resolve() != target:
            return real(file, mode)
        if not shared:
            gguf_reader.np = types.SimpleNamespace(**{**vars(np), "memmap": in_memory})  # this module's np only
            try:
                shared.append(real(file, mode))
            finally:
                gguf_reader.np = np
        return shared[0]

    gguf.GGUFReader = reader
    try:
        yield
    finally:
        gguf.GGUFReader = real


class FailingTracer:
    """A tracer whose hook raises at one hook point: a forward pass that fails part-way through the layers."""

    def __init__(self, at: str = "layers.1.attn.q") -> None:
        self.at = at

    def hook(self, name, t):
        if name == self.at:
            raise RuntimeError("boom")

    def wants_attention(self, layer):
        return False


def no_cache_logits(model, ids, last: bool = False, batched: bool = False, **forward) -> torch.Tensor:
    """The no-cache reference every test compares against: ``model``'s logits for ``ids`` in one pass with nothing
    cached (kvexplore's ``NoCache``), ``(T, vocab)``; ``last``: the last row only. ``ids``: a list of ids, or with
    ``batched`` a ``(B, T)`` tensor (``(B, T, vocab)`` back). ``forward``: options of the forward pass (a tracer)."""
    import kvexplore

    x = ids if batched else torch.tensor([list(ids)])
    out = model(x, kvexplore.NoCache(model.config, batch_size=x.shape[0], dtype=model.dtype), 0, **forward)
    out = out if batched else out[0]
    return out[..., -1, :] if last else out
