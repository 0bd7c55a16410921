"""llama.cpp's KV cache types (``make_cache("quantized", model, k_type=..., v_type=...)``): the blocks the cache
stores are byte for byte what the ``gguf`` package's reference quantizer makes of the same rows (random rows with
zero, constant and tied blocks, and the keys and values a real model writes), they read back as its dequantizer's
floats, the bytes are the formula's, and a failed step, a rollback and a rewind leave the blocks exact."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

import kvexplore
from helpers import FailingTracer
from kvexplore.caches import ggml_blocks
from kvexplore.errors import SettingsError

gguf_quants = pytest.importorskip("gguf.quants")
from gguf import GGMLQuantizationType  # noqa: E402

QUANTIZED = ("q8_0", "q5_1", "q5_0", "q4_1", "q4_0")
BYTES = {"q8_0": 34, "q5_1": 24, "q5_0": 22, "q4_1": 20, "q4_0": 18, "f16": 64, "bf16": 64}  # ggml's block sizes
PROMPT = "Call me Ishmael. Some years ago, never mind how long precisely, having little or no money in my purse"


def reference(x: torch.Tensor, ctype: str) -> np.ndarray:
    """gguf's own quantizer: uint8 blocks of ``x``'s rows."""
    return gguf_quants.quantize(x.float().numpy(), getattr(GGMLQuantizationType, ctype.upper())).view(np.uint8)


def awkward_rows() -> torch.Tensor:
    """Random rows at three scales, with blocks that are all zero, constant, or tied at the largest magnitude."""
    torch.manual_seed(0)
    rows = torch.cat([torch.randn(3, 5, 64) * s for s in (1e-3, 1.0, 40.0)])
    rows[0, 0, :32] = 0
    rows[1, 0, :32] = 0.25
    rows[2, 1, 5] = -rows[2, 1, :32].abs().max()  # two values of the largest magnitude, opposite signs
    rows[3, 2, 32:] = torch.linspace(-1, 1, 32)
    return rows


@pytest.mark.parametrize("ctype", ggml_blocks.TYPES)
def test_blocks_equal_gguf_byte_for_byte_and_read_back_as_its_floats(ctype):
    rows = awkward_rows()
    mine = ggml_blocks.quantize(rows, ctype)
    want = reference(rows, ctype)
    assert mine.shape == (*rows.shape[:-1], 64 // 32 * BYTES[ctype])
    assert np.array_equal(mine.numpy(), want.reshape(mine.shape))
    qtype = getattr(GGMLQuantizationType, ctype.upper())
    back = gguf_quants.dequantize(want, qtype) if ctype in QUANTIZED else want.view(
        np.float16 if ctype == "f16" else np.uint16)
    if ctype == "bf16":  # gguf reads bfloat16 back by shifting into a float32's high half
        back = (back.astype(np.uint32) << 16).view(np.float32)
    assert np.array_equal(ggml_blocks.dequantize(mine, ctype).numpy(), np.asarray(back, dtype=np.float32)
                          .reshape(rows.shape))


class Rows:
    """A tracer that keeps the key and value rows each layer writes (what the cache is handed)."""

    def __init__(self):
        self.rows = {}

    def wants_attention(self, layer):
        return False

    def hook(self, name, t):
        if name.endswith((".k_new", ".v_new")):
            self.rows[int(name.split(".")[1]), name[-5]] = t.clone()


def test_the_cache_stores_the_models_rows_as_gguf_quantizes_them(trained):
    """The keys and values the packaged tiny model hands the cache in a prefill (each layer's own, after the loss of
    the layers before it) against the blocks a cache of each type holds."""
    ids = [trained.tokenizer.bos_id, *trained.tokenizer.encode(PROMPT)]
    n = len(ids)
    for k_type, v_type in (("q4_0", "q8_0"), ("q5_1", "q4_1"), ("q5_0", "f16"), ("q8_0", "bf16")):
        cache, rows = kvexplore.make_cache("quantized", trained, max_seq_len=64, k_type=k_type, v_type=v_type), Rows()
        trained(torch.tensor([ids]), cache, 0, tracer=rows)
        for layer in range(trained.config.num_layers):
            kb, vb = (t[:, :, :n] for t in cache.blocks(layer))
            assert np.array_equal(kb.numpy(), reference(rows.rows[layer, "k"], k_type).reshape(kb.shape)), layer
            assert np.array_equal(vb.numpy(), reference(rows.rows[layer, "v"], v_type).reshape(vb.shape)), layer


def test_bytes_are_the_blocks_and_the_formula(trained):
    c = trained.config
    cache = kvexplore.make_cache("quantized", trained, max_seq_len=96, k_type="q4_0", v_type="q8_0")
    gen = kvexplore.Generator(trained, cache)
    gen.prefill(PROMPT)
    gen.run(3, stop_at_eos=False)
    per_position = c.num_kv_heads * c.head_dim // 32 * (18 + 34)  # a key row of q4_0 blocks, a value row of q8_0
    assert cache.inspect.reserved_bytes == c.num_layers * 96 * per_position
    report = cache.inspect.memory_report()
    assert report.logical_bytes == c.num_layers * cache.length * per_position
    assert report.held["keys and values"] == cache.inspect.reserved_bytes
    assert ggml_blocks.bits_per_value("q4_0") == 4.5 and ggml_blocks.bits_per_value("q5_1") == 6.0


def test_a_failed_step_a_rollback_and_a_rewind_leave_the_blocks_exact(trained):
    gen = kvexplore.Generator(trained, kvexplore.make_cache("quantized", trained, max_seq_len=96, k_type="q4_1",
                                                            v_type="q5_0"))
    gen.prefill(PROMPT)
    gen.run(4, stop_at_eos=False)
    cache = gen.cache
    before = [tuple(t.clone() for t in cache.blocks(i)) for i in range(trained.config.num_layers)]
    tokens = list(gen.tokens)
    with pytest.raises(RuntimeError, match="boom"):
        trained(torch.tensor([[tokens[-1]]]), cache, cache.length, tracer=FailingTracer("layers.3.attn.q"))
    gen.step(keep_undo=True)
    gen.undo_step()
    for i, (k, v) in enumerate(before):
        assert torch.equal(cache.blocks(i)[0], k) and torch.equal(cache.blocks(i)[1], v), i
    assert gen.tokens == tokens
    gen.run(3, stop_at_eos=False)
    again = list(gen.tokens)
    gen.rewind(3)
    gen.run(3, stop_at_eos=False)
    assert gen.tokens == again


def test_lower_bits_lose_more_and_the_doctor_judges_them_by_design(trained):
    """Teacher-forced over a passage: KL to the full-precision cache grows as the key type loses bits; the doctor
    calls each cache lossy by design and finds no bug in it."""
    ids = [trained.tokenizer.bos_id, *trained.tokenizer.encode(PROMPT * 2)][:80]
    full = trained(torch.tensor([ids]), kvexplore.make_cache("preallocated", trained, max_seq_len=96), 0)[0]

    def kl(k_type):
        cache = kvexplore.make_cache("quantized", trained, max_seq_len=96, k_type=k_type, v_type="f16")
        out = torch.cat([trained(torch.tensor([ids[:8]]), cache, 0)[0]] +
                        [trained(torch.tensor([[t]]), cache, p)[0] for p, t in enumerate(ids[8:], 8)])
        p = full.log_softmax(-1)
        return float((p.exp() * (p - out.log_softmax(-1))).sum(-1).mean())

    kls = {k: kl(k) for k in ("f16", "q8_0", "q5_1", "q4_0")}
    assert kls["f16"] < 1e-5 < kls["q8_0"] < kls["q5_1"] < kls["q4_0"], kls
    for k_type in ("q8_0", "q4_0"):
        report = kvexplore.doctor(trained, prompt=PROMPT, steps=4, cache=kvexplore.make_cache(
            "quantized", trained, max_seq_len=96, k_type=k_type, v_type=k_type))
        assert not report.diverged and report.lossy.startswith("llama.cpp cache types"), report.summary()


def test_bad_options_say_what_is_wrong(trained):
    with pytest.raises(SettingsError, match=r"unknown k_type .*'q3_0'.*q8_0, q5_1, q5_0, q4_1, q4_0, f16, bf16"):
        kvexplore.make_cache("quantized", trained, k_type="q3_0")
    with pytest.raises(SettingsError, match=r"leave out \['bits', 'residual'\]"):
        kvexplore.make_cache("quantized", trained, k_type="q4_0", bits=4, residual=8)
    with pytest.raises(SettingsError) as refused:
        kvexplore.make_cache("quantized", trained, max_seq_len=32, k_typ="q4_0")
    message = str(refused.value)
    assert "does not take ['k_typ']" in message and "max_seq_len" not in message.split("; it takes")[0]
    assert "k_type" in message.split("; it takes")[1]
    narrow = kvexplore.Model(dataclasses.replace(trained.config, head_dim=16))
    with pytest.raises(SettingsError, match="blocks of 32 values, and this layer's rows are 16 wide"):
        kvexplore.make_cache("quantized", narrow, k_type="q8_0")
