"""The doctor on a cache that is lossy by design (the quantized one): exact until it first quantizes, then judged
against its scheme's bound (half a quantization step per element) instead of as a bug; a planted bug in its codes is
still named as one."""

from __future__ import annotations

import pytest
import torch

import kvexplore
from kvexplore.caches.layers import quantized_layer

PROMPT = [1, 5, 9, 20, 33, 7]


def _cache(model, bits=8):
    return kvexplore.make_cache("quantized", model, max_seq_len=40, bits=bits, group_size=8, residual=4)


@pytest.mark.parametrize("bits", [4, 8])
def test_a_quantized_cache_is_judged_against_its_scheme(tiny, bits):
    cache = _cache(tiny, bits)
    report = kvexplore.doctor(tiny, prompt=PROMPT, steps=30, cache=cache)
    # the first block of 8 is quantized once 4 newer positions follow it: at 12 positions, the step fed position 11
    assert not report.diverged and report.step == 12 - len(PROMPT) and report.steps == report.step + 1
    assert cache.quantized_upto == 8 and report.lossy == cache.inspect.what_it_did()
    assert 0 < report.scheme_error <= report.scheme_bound * (1 + 1e-5) + 1e-6
    # the bound is half a step of the widest group: (max - min) / (2 ** bits - 1) / 2 of some block's channel
    assert report.scheme_bound < 10 / (2 ** bits - 1)
    text = report.summary()
    assert text.startswith(f"lossy by design (quantized cache: positions 0..7 quantized to {bits} bits")
    assert "inside the scheme's bound at every element" in text and "by design, so the check stops" in text


def test_a_code_off_by_one_step_is_still_a_bug(tiny, monkeypatch):
    real = quantized_layer.QuantizedLayer.encode

    def off_by_one(self, codec, x, positions):
        stored = real(self, codec, x, positions)
        if codec is self.kcodec:  # every key a step higher
            stored["codes"] = (stored["codes"].int() + 1).clamp(max=2 ** codec.bits - 1).to(torch.uint8)
        return stored

    monkeypatch.setattr(quantized_layer.QuantizedLayer, "encode", off_by_one)
    report = kvexplore.doctor(tiny, prompt=PROMPT, steps=30, cache=_cache(tiny))
    assert report.diverged and report.what == "keys" and report.step == 12 - len(PROMPT)
    assert report.position is not None and report.position < 8
    assert "further from the recomputation's than the scheme allows" in report.hint
    assert "a bug in the cache, not its designed loss" in report.hint


def test_the_command_line_exits_zero_on_a_lossy_by_design_cache(capsys):
    from kvexplore import cli

    assert cli.main(["doctor", "tiny", "--cache", "quantized", "--steps", "64"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("lossy by design (quantized cache: positions 0..31 quantized to 8 bits")
