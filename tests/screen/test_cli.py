"""``kvexplore generate``: streams text, ends with speed and cache bytes; bad input is one line and non-zero."""

import re
import shutil
import subprocess

import pytest
from pathlib import Path

import kvexplore
from kvexplore.cli import main


@pytest.fixture(scope="module")
def source(checkpoint):
    return str(checkpoint("llama-gqa2")[0])


def test_generate_streams_the_greedy_text(source, capsys):
    assert main(["generate", source, "--prompt", "Call me Ishmael.", "--max-new-tokens", "12", "--no-stop"]) == 0
    out = capsys.readouterr().out
    model = kvexplore.load(source)
    gen = kvexplore.Generator(model, kvexplore.PreallocatedCache(model.config, 64))
    gen.prefill("Call me Ishmael.")
    gen.run(11, stop_at_eos=False)
    text, stats = out.rsplit("\n\n", 1)
    assert text == gen.text
    prompt_len = len(gen.prompt_tokens)
    per_token = kvexplore.kv_bytes(model.config, 1)
    m = re.fullmatch(r"\[12 tokens in [\d.]+ s: prefill (\d+) tokens in \d+ ms, decode [\d.]+ tokens/s \| cache "
                     r"preallocated: ([\d.]+) MiB reserved, ([\d.]+) MiB used for (\d+) positions \((\d+) bytes per "
                     r"token\)\]\n", stats)
    assert m, stats
    assert int(m[1]) == prompt_len and int(m[4]) == prompt_len + 11 and int(m[5]) == per_token
    assert float(m[2]) == pytest.approx(per_token * (prompt_len + 12) / 2**20, abs=0.01)


def test_generate_without_a_cache(source, capsys):
    assert main(["generate", source, "--prompt", "Call me", "--max-new-tokens", "4", "--cache", "none"]) == 0
    assert "cache none: 0.00 MiB reserved" in capsys.readouterr().out


def _generate(source, capsys, *options, n=40):
    assert main(["generate", source, "--prompt", "Call me Ishmael.", "--max-new-tokens", str(n), "--no-stop",
                 *options]) == 0
    return capsys.readouterr().out.rstrip("\n").rsplit("\n", 1)[-1]


def test_lossy_caches_take_their_sizes_and_say_what_they_did(source, capsys):
    """--cache sink evicts with its defaults (4 sinks, a window of 28) and says so; a window that holds the run says
    the run is exact; --cache quantized says when a run is too short to quantize anything, and what it quantized."""
    model = kvexplore.load(source)
    prompt = len(model.tokenizer.encode("Call me Ishmael.")) + model.tokenizer.add_bos
    n = prompt + 39  # positions a 40-token run leaves in the cache
    assert _generate(source, capsys, "--cache", "sink") == (
        f"[sink cache: evicted {n - 32} positions, keeps the first 4 and the last 28]")
    assert _generate(source, capsys, "--cache", "sink", "--sinks", "0", "--window", "100") == (
        f"[sink cache: nothing evicted yet: all {n} positions fit in 0 sinks + a window of 100 (a smaller window "
        f"evicts sooner)]")
    assert _generate(source, capsys, "--cache", "quantized") == (
        f"[quantized cache: nothing quantized yet: all {n} positions are inside the residual (a block of 32 is "
        f"quantized once 32 newer positions follow it, from 64 positions on; a smaller residual or group_size "
        f"quantizes sooner)]")
    q = (n - 4) // 8 * 8  # whole blocks of 8 with at least 4 newer positions after them
    assert _generate(source, capsys, "--cache", "quantized", "--bits", "4", "--group-size", "8", "--residual",
                     "4") == (f"[quantized cache: positions 0..{q - 1} quantized to 4 bits, the last {n - q} kept in "
                              f"full precision]")
    assert _generate(source, capsys, "--cache", "quantized", "--key-bits", "2", "--value-bits", "8", "--group-size",
                     "8", "--residual", "4") == (f"[quantized cache: positions 0..{q - 1} quantized to 2-bit keys and "
                                                 f"8-bit values, the last {n - q} kept in full precision]")
    assert _generate(source, capsys, "--cache", "quantized", "--bits", "4", "--group-size", "8", "--residual", "4",
                     "--key-axis", "token", "--value-axis", "channel", "--rotate", "hadamard", "--pre-rope-keys",
                     "--outliers", "0.1") == (
        f"[quantized cache: positions 0..{q - 1} quantized to 4 bits (keys per token, values per channel, pre-RoPE "
        f"keys, Hadamard-rotated, 2 outliers a vector kept exact), the last {n - q} kept in full precision]")
    assert _generate(source, capsys, "--cache", "quantized", "--bits", "4", "--group-size", "8", "--residual", "4",
                     "--exact-prefill") == (f"[quantized cache: positions 0..{q - 1} quantized to 4 bits "
                                            f"(full-precision prefill), the last {n - q} kept in full precision]")
    # llama.cpp's types need rows of 32 values: the packaged tiny model's heads (this source's are 16 wide)
    assert _generate("tiny", capsys, "--cache", "quantized", "--cache-type-k", "q4_0", "--cache-type-v", "q8_0",
                     n=4).endswith("[llama.cpp cache types: keys q4_0 (4.5 bits a value), values q8_0 (8.5 bits a "
                                   "value); all 9 positions stored quantized as they were written]")
    assert _generate(source, capsys, n=4).startswith("[4 tokens in")  # an exact cache says nothing more


def test_the_docs_list_every_cache_option_as_the_strategies_declare_it():
    from kvexplore.cli.cache_options import table

    assert table() in (Path(__file__).resolve().parents[2] / "docs" / "cli.md").read_text(), (
        "docs/cli.md's table of generate's cache options is not the strategies' declaration: paste "
        "kvexplore.cli.cache_options.table() there")


def test_every_strategys_declared_options_are_flags_of_generate(source, capsys):
    """The flags come from the strategies' own Options (kvexplore.caches.options): the evict cache's press and budget
    too, checked by the option's own check as they are parsed."""
    from kvexplore.caches.registry import STRATEGIES
    from kvexplore.cli.commands import build_parser

    text = build_parser()._subparsers._group_actions[0].choices["generate"].format_help()
    for kind in STRATEGIES:
        for f, spec in STRATEGIES[kind].Options.specs():
            if spec.flag is not None:
                assert (spec.flag.name or f"--{f.name.replace('_', '-')}") in text, f.name
    prompt = len(kvexplore.load(source).tokenizer.encode("Call me Ishmael.")) + 1
    assert _generate(source, capsys, "--cache", "evict", "--press", "snapkv", "--compression-ratio", "0.5", n=4) == (
        f"[evict cache (snapkv): 1 press, the last (prompt) at {prompt} positions kept {prompt // 2} per head in "
        f"{kvexplore.load(source).config.num_layers} pressed layers]")
    assert exit_code(["generate", source, "--prompt", "x", "--cache", "evict", "--compression-ratio", "1.5"]) == 1
    assert "compression_ratio must be >= 0.0 and < 1" in capsys.readouterr().err
    assert exit_code(["generate", source, "--prompt", "x", "--cache", "evict", "--decode-every", "0"]) == 2
    assert "argument --decode-every: decode_every must be at least 1" in capsys.readouterr().err


def test_cache_full_is_one_line(source, capsys):
    assert main(["generate", source, "--prompt", "Call me Ishmael.", "--max-new-tokens", "30", "--no-stop",
                 "--max-seq-len", "20"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("kvexplore generate: error: cache full: 20 of 20 slots used")


def exit_code(argv):
    try:
        return main(argv)
    except SystemExit as e:  # argparse exits on its own errors
        return e.code


@pytest.mark.parametrize("argv, message", [
    (["generate", "/no/such/model", "--prompt", "x"],
     "model source '/no/such/model' is not a named model, a folder or a .gguf file"),
    (["generate", "{src}", "--prompt", "x", "--dtype", "float8"], "argument --dtype: invalid choice: 'float8'"),
    (["generate", "{src}", "--prompt", "x", "--max-new-tokens", "0"], "must be a positive integer, got 0"),
    (["generate", "{src}", "--prompt", "x", "--cache", "ring"], "argument --cache: invalid choice: 'ring'"),
    (["generate", "{src}", "--prompt", "x", "--top-p", "2"],
     "top_p must be > 0 and <= 1 (or None for no limit), got 2.0"),
    (["generate", "{src}"], "the following arguments are required: --prompt"),
    (["generate", "{src}", "--prompt", "x", "--window", "8"], "--window is an option of --cache sink, not of --cache "
                                                             "preallocated"),
    (["generate", "{src}", "--prompt", "x", "--cache", "sink", "--residual", "8"],
     "--residual is an option of --cache quantized, not of --cache sink"),
    (["generate", "{src}", "--prompt", "x", "--cache", "quantized", "--bits", "5"],
     "argument --bits: invalid choice: 5"),
    (["generate", "{src}", "--prompt", "x", "--cache", "sink", "--cache-type-k", "q4_0"], "--cache-type-k is an option "
                                                                                          "of --cache quantized"),
    (["generate", "{src}", "--prompt", "x", "--cache", "quantized", "--cache-type-v", "q3_0"],
     "argument --cache-type-v: invalid choice: 'q3_0'"),
    (["generate", "{src}", "--prompt", "x", "--cache", "quantized", "--cache-type-k", "q4_0", "--bits", "4"],
     "leave out ['bits']"),
    (["generate", "{src}", "--prompt", "x", "--cache", "sink", "--sinks", "-1"],
     "argument --sinks: sinks must be at least 0, got -1"),
])
def test_bad_arguments(source, capsys, argv, message):
    code = exit_code([a.replace("{src}", source) for a in argv])
    err = capsys.readouterr().err
    assert code in (1, 2)  # 2: argparse refused the arguments, 1: kvexplore refused the values
    assert err.count("\n") == 1 and message in err, err


@pytest.mark.long  # the console script in a subprocess
@pytest.mark.skipif(shutil.which("kvexplore") is None, reason="the console script is not installed")
def test_console_script(source):
    run = subprocess.run(["kvexplore", "generate", source, "--prompt", "Call me", "--max-new-tokens", "3"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and "tokens/s" in run.stdout, run.stderr


def test_a_listing_cut_short_by_its_reader_ends_quietly():
    """``kvexplore course list | true``: the reader is gone before the first line; no "Broken pipe" error, exit 0."""
    import subprocess
    import sys

    line = f"set -o pipefail; {sys.executable} -m kvexplore course list | true"
    run = subprocess.run(["bash", "-c", line], capture_output=True, text=True)
    assert run.returncode == 0 and run.stderr == "", run.stderr
