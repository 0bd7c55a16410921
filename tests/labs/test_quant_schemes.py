"""The quantized cache's schemes (issue 41): keys and values on either axis, a Hadamard rotation, pre-RoPE keys and
outliers kept exact, each decoding as its own quantize-then-dequantize reference (tests/support/quant_reference.py,
written apart from the cache) on Llama (the packaged tiny model), Gemma 3 (sliding rings beside the quantized full
layers) and Qwen3-Next (recurrent layers beside them, keys rotated on a quarter of their channels)."""

from __future__ import annotations

import math

import pytest
import torch

import kvexplore
from kvexplore.caches.strategies.quantized import QuantizedCache
from quant_reference import FakeQuantCache, teacher_forced_logits

SCHEMES = {
    "kivi-4": dict(key_bits=4, value_bits=4),
    "axes-swapped-2-3": dict(key_bits=2, value_bits=3, key_axis="token", value_axis="channel"),
    "hadamard-4": dict(key_bits=4, value_bits=4, rotate="hadamard"),
    "pre-rope-2-4": dict(key_bits=2, value_bits=4, pre_rope_keys=True),
    "outliers-3-2": dict(key_bits=3, value_bits=2, outliers=0.1),
    "everything-2": dict(key_bits=2, value_bits=2, key_axis="token", rotate="hadamard", pre_rope_keys=True,
                         outliers=0.05),
    "exact-prefill-2": dict(key_bits=2, value_bits=2, exact_prefill=True),
}
MODELS = {"llama": None, "gemma3": ("gemma3", dict(layers=3, sliding_window=6)), "qwen3_next": ("qwen3_next", {})}
GROUP, RESIDUAL, CAPACITY = 8, 4, 64


def _model(zoo, name):
    if MODELS[name] is None:
        return zoo.trained
    arch, options = MODELS[name]
    return zoo.load(arch, **options)


def _ids(model, n: int = 40) -> list[int]:
    return torch.randint(3, model.config.vocab_size, (n,), generator=torch.Generator().manual_seed(7)).tolist()


@pytest.mark.parametrize("model_name", list(MODELS))
@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_decoding_equals_its_quantize_dequantize_reference(zoo, model_name, scheme):
    """Prefill 21 tokens (blocks leave the window inside the prefill), then 19 one-token steps (a block leaves
    every 8): the logits at every step within 1e-4 of the reference's, and the reference's differ from the
    full-precision cache's (the scheme does something)."""
    model = _model(zoo, model_name)
    options = dict(SCHEMES[scheme], group_size=GROUP, residual=RESIDUAL)
    ids = _ids(model)
    cache = kvexplore.make_cache("quantized", model, max_seq_len=CAPACITY, **options)
    got = teacher_forced_logits(model, cache, ids, 21)
    want = teacher_forced_logits(model, FakeQuantCache(model, CAPACITY, **options), ids, 21)
    exact = teacher_forced_logits(model, kvexplore.make_cache("preallocated", model, max_seq_len=CAPACITY), ids, 21)
    assert cache.quantized_upto == (40 - RESIDUAL) // GROUP * GROUP
    scale = float(want.abs().max())
    assert float((got - want).abs().max()) <= 1e-4 * max(scale, 1), (scheme, float((got - want).abs().max()))
    assert float((want - exact).abs().max()) > 1e-3 * scale


@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_bytes_are_the_stored_tensors_and_follow_the_formula(tiny, scheme):
    """The report's integers, scales and outliers are the layer's own tensors; per element: ``bits`` of code, two
    float32 per group (scale and zero), and per outlier an int16 channel and a float32 value."""
    options = dict(SCHEMES[scheme], group_size=GROUP, residual=RESIDUAL)
    cache = QuantizedCache(tiny.config, CAPACITY, **options)
    c, nq = tiny.config, CAPACITY // GROUP * GROUP
    per_head = c.num_layers * c.num_kv_heads * nq  # positions x heads x layers that can be quantized
    D = c.head_dim
    kb, vb = options["key_bits"], options["value_bits"]
    n = math.ceil(options.get("outliers", 0) * D)
    want = {"integers": per_head * D * (kb + vb) // 8,
            "scales": 2 * 2 * 4 * per_head * D // min(GROUP, D),  # K and V, scale and zero, float32, one per group
            "residual": 2 * 4 * c.num_layers * c.num_kv_heads * min(CAPACITY, RESIDUAL + GROUP - 1) * D}
    if n:
        want["outliers"] = 2 * per_head * n * (2 + 4)
    assert cache.quantization.bytes_breakdown() == want
    layers = [cache.layers[i] for i in cache.full_layers]
    held = lambda *names: sum(getattr(l, a).nbytes for l in layers for a in names if getattr(l, a) is not None)  # noqa
    assert want["integers"] == held("kq", "vq") and want["scales"] == held("ks", "kz", "vs", "vz")
    assert want.get("outliers", 0) == held("koi", "kov", "voi", "vov")
    codec = layers[0].kcodec
    assert codec.bits_per_value(D, 4) == pytest.approx(kb + 64 / codec.group + n * 48 / D)


def test_keys_are_the_sensitive_half_and_what_tames_an_outlier_channel(tiny):
    """One key channel 50x larger than the others: per-token codes lose the other channels to it (the scale is the
    outlier's), a Hadamard rotation spreads it (error / 1.8 at 16 channels, more on wider heads) and outliers kept exact
    remove it (error / 10); per-channel codes isolate it by themselves (KIVI's reason for keys per channel), and a
    rotation then spreads it back into every channel. On the model: 2-bit keys with 8-bit values lose more than the
    reverse."""
    ids = tiny.tokenizer.encode("Call me Ishmael. Some years ago, never mind how long precisely, having little or "
                                "no money in my purse, and nothing particular to interest me on shore")[:40]
    D = tiny.config.head_dim
    k = torch.randn(1, 2, 32, D, generator=torch.Generator().manual_seed(0))
    k[..., 3] *= 50  # one outlier channel
    positions = torch.arange(32)
    err = {}
    for axis in ("token", "channel"):
        for name, opts in {"plain": {}, "hadamard": dict(rotate="hadamard"), "outliers": dict(outliers=1 / D)}.items():
            cache = QuantizedCache(tiny.config, 64, key_bits=4, key_axis=axis, group_size=32, **opts)
            codec = cache.layers[0].kcodec
            back = codec.decode(codec.encode(k, positions, None, torch.float32), positions, None)
            err[axis, name] = float((back - k)[..., [c for c in range(D) if c != 3]].abs().mean())  # the others
    assert err["token", "hadamard"] < err["token", "plain"] / 1.8, err
    assert err["token", "outliers"] < err["token", "plain"] / 10, err
    assert err["channel", "plain"] < err["token", "plain"] / 4 < err["channel", "hadamard"], err
    kl = {}
    exact = teacher_forced_logits(tiny, kvexplore.make_cache("preallocated", tiny, max_seq_len=64), ids, 21)
    for kb, vb in ((2, 8), (8, 2)):
        cache = kvexplore.make_cache("quantized", tiny, max_seq_len=64, key_bits=kb, value_bits=vb, group_size=8,
                                     residual=4)
        got = teacher_forced_logits(tiny, cache, ids, 21)
        p = exact.log_softmax(-1)
        kl[kb, vb] = float((p.exp() * (p - got.log_softmax(-1))).sum(-1).mean())
    assert kl[2, 8] > kl[8, 2], kl


def test_pre_rope_keys_need_the_model_and_say_so(tiny):
    cache = kvexplore.make_cache("quantized", tiny, max_seq_len=32, group_size=8, residual=0, pre_rope_keys=True)
    k = torch.randn(1, tiny.config.num_kv_heads, 8, tiny.config.head_dim)
    with pytest.raises(kvexplore.KVExploreError, match="pre_rope_keys=True\\) needs the model's rotary embedding"):
        cache.write(0, 0, k, k)
    assert cache.length == 0 and cache.quantized_upto == 0
    tiny(torch.tensor([list(range(3, 11))]), cache, 0)  # through the model: attached
    assert cache.quantized_upto == 8


def test_the_scheme_is_in_the_slot_view_and_the_doctor_finds_no_bug(tiny):
    options = SCHEMES["everything-2"]
    cache = kvexplore.make_cache("quantized", tiny, max_seq_len=64, group_size=8, residual=4, **options)
    summary = cache.inspect.slot_view(0).layout.summary()
    assert "keys per token, pre-RoPE keys, Hadamard-rotated, 1 outliers a vector kept exact" in summary, summary
    report = kvexplore.doctor(tiny, prompt="Call me Ishmael.", steps=20, cache=cache)
    assert not report.diverged and report.lossy, report.summary()
    assert 0 < report.scheme_error <= report.scheme_bound * (1 + 1e-5) + 1e-6


def test_the_error_per_channel_is_what_the_codes_lose_and_the_stored_kv_view_draws_it(tiny):
    """Layer 0 reads nothing lossy before it writes, so its keys are the full cache's: its error per channel is the
    largest |k - dequant(quant(k))| of each channel over the quantized positions (keys per channel, blocks of 8), and
    the Stored K/V view draws it beside the error per position, each part scaled to its own largest error."""
    from kvexplore.caches.kivi import dequantize, quantize
    from kvexplore.views import tensors

    ids = torch.tensor([_ids(tiny, 37)])
    cache = kvexplore.make_cache("quantized", tiny, max_seq_len=64, key_bits=2, value_bits=4, group_size=8,
                                 residual=4)
    full = kvexplore.make_cache("preallocated", tiny, max_seq_len=64)
    tiny(ids, cache, 0)
    tiny(ids, full, 0)
    q = cache.quantized_upto
    assert q == 32
    k, v = (t[:, :, :q].float() for t in full.inspect.storage(0))
    want_k = (dequantize(*quantize(k, 2, "channel", 8), 2, "channel") - k).abs()[0].amax(1)
    want_v = (dequantize(*quantize(v, 4, "token", 8), 4, "token") - v).abs()[0].amax(1)
    got_k, got_v = cache.quantization.channel_error(0)
    assert torch.allclose(got_k, want_k, atol=1e-6) and torch.allclose(got_v, want_v, atol=1e-6)
    assert kvexplore.make_cache("preallocated", tiny, max_seq_len=8).quantization is None  # exact: no facet
    figure = tensors.spec(None, None, 0, cache.quantization.stored_error(0), cache.inspect.slot_view(0),
                          channel_error=(got_k, got_v))
    by_name = {t["name"]: t for t in figure.traces}
    assert by_name["keys error per channel"]["z"].tolist() == got_k.reshape(-1).tolist()
    assert by_name["values error per channel"]["zmax"] == pytest.approx(float(got_v.max()))
    assert figure.layout["xaxis4"]["title"]["text"] == f"K ≤ {float(got_k.max()):.2g}"
    exact = tensors.spec(None, None, 0, None, full.inspect.slot_view(0))
    assert not any("per channel" in t["name"] for t in exact.traces) and "xaxis4" not in exact.layout


def test_a_full_precision_prefill_reads_the_prompt_as_computed_and_the_doctor_agrees(tiny):
    """``exact_prefill=True``: the prompt's own pass reads its keys as computed (KIVI's and transformers' prefill),
    the storage holds the codes all the same; the prefill's logits are the full cache's, the next step's are not."""
    ids = torch.tensor([_ids(tiny, 30)])
    full = kvexplore.make_cache("preallocated", tiny, max_seq_len=64)
    options = dict(key_bits=2, value_bits=2, group_size=8, residual=4)
    exact, lossy = (kvexplore.make_cache("quantized", tiny, max_seq_len=64, exact_prefill=e, **options)
                    for e in (True, False))
    want = tiny(ids, full, 0)
    assert torch.allclose(tiny(ids, exact, 0), want, atol=1e-5)
    assert not torch.allclose(tiny(ids, lossy, 0), want, atol=1e-3)
    assert exact.quantized_upto == lossy.quantized_upto == 24
    assert exact.quantization.bytes_breakdown() == lossy.quantization.bytes_breakdown()
    report = kvexplore.doctor(tiny, prompt=_ids(tiny, 30), steps=6, cache=kvexplore.make_cache(
        "quantized", tiny, max_seq_len=64, exact_prefill=True, **options))
    assert not report.diverged and "full-precision prefill" in report.lossy


def test_each_channels_worst_block_and_its_outlier_channels_before_and_after_a_rotation(tiny):
    """``channel_detail``: per KV head and channel, the block of 8 positions where the channel lost the most, its
    codes, scale and zero point there (the quantizer's own, read back from the storage), and the channel's largest
    magnitude as written and where the codes are taken. A key channel 50x the others is an outlier as written; a
    Hadamard rotation leaves no outlier where the codes are taken. The Stored K/V view puts the block on the
    channel's hover and rings the outlier channels (crosses where quantized)."""
    from kvexplore.caches.kivi import quantize, unpack
    from kvexplore.views import tensors

    H, D = tiny.config.num_kv_heads, tiny.config.head_dim
    gen = torch.Generator().manual_seed(1)
    k, v = torch.randn(1, H, 24, D, generator=gen), torch.randn(1, H, 24, D, generator=gen)
    k[..., 3] *= 50
    cache = kvexplore.make_cache("quantized", tiny, max_seq_len=32, key_bits=4, value_bits=2, group_size=8,
                                 residual=0)
    assert cache.quantization.channel_detail(0) is None  # nothing quantized yet
    cache.write(0, 0, k, v)
    kd, vd = cache.quantization.channel_detail(0)
    for part, x, d, bits, axis in (("keys", k, kd, 4, "channel"), ("values", v, vd, 2, "token")):
        codes, scale, zero = quantize(x, bits, axis, 8)
        codes = unpack(codes, bits)[0]
        err = cache.quantization.channel_error(0)[part == "values"]
        assert d.part == part and d.bits == bits and d.axis == axis and d.quantized is None
        per_block = torch.stack([(cache.layers[0].decode(part[0], 8 * b, 8 * b + 8) - x[..., 8 * b:8 * b + 8, :])
                                 .abs()[0].amax(1) for b in range(3)], 1)  # (H, blocks, D)
        assert torch.equal(d.block, per_block.argmax(1)) and torch.allclose(per_block.amax(1), err)
        for h in range(H):
            for c in range(D):
                b = int(d.block[h, c])
                rows = slice(8 * b, 8 * b + 8)
                assert d.codes[h, c].tolist() == codes[h, rows, c].tolist()
                want_s = scale[0, h, b, c] if axis == "channel" else scale[0, h, rows, c // 8]
                want_z = zero[0, h, b, c] if axis == "channel" else zero[0, h, rows, c // 8]
                assert torch.equal(d.scale[h, c].flatten(), want_s.flatten())
                assert torch.equal(d.zero[h, c].flatten(), want_z.flatten())
        assert torch.allclose(d.written, cache.layers[0].decode(part[0], 0, 24)[0].abs().amax(1))
    assert kd.outliers()[:, 3].all() and kd.outliers().sum() == H and not vd.outliers().any()
    rotated = kvexplore.make_cache("quantized", tiny, max_seq_len=32, key_bits=4, value_bits=2, group_size=8,
                                   residual=0, rotate="hadamard")
    rotated.write(0, 0, k, v)
    rk, _ = rotated.quantization.channel_detail(0)
    assert rk.outliers()[:, 3].all() and rk.quantized is not None and not rk.outliers("quantized").any()
    assert kvexplore.make_cache("preallocated", tiny, max_seq_len=8).quantization is None

    for c, d in ((cache, kd), (rotated, rk)):
        figure = tensors.spec(None, None, 0, c.quantization.stored_error(0), c.inspect.slot_view(0),
                              channel_error=c.quantization.channel_error(0),
                              channel_detail=c.quantization.channel_detail(0))
        by_name = {t["name"]: t for t in figure.traces}
        hover = by_name["keys error per channel"]["text"]
        b = int(d.block[1, 3])
        assert len(hover) == H * D and hover[D + 3].startswith(f"block {b} (positions {8 * b}..{8 * b + 7}), 4-bit")
        assert " ".join(str(x) for x in d.codes[1, 3, :8].tolist()) in hover[D + 3]
        ring = by_name["keys: outlier channels as written"]
        assert ring["x"].tolist() == [3] * H and ring["y"].tolist() == list(range(H))
        assert ("keys: outlier channels where quantized" in by_name) == (c is rotated)
    assert len(by_name["keys: outlier channels where quantized"]["x"]) == 0
