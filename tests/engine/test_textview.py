"""The terminal cache map: one symbol per slot, written window, stale slots, shared pages, memory figures."""

import re

import torch

import kvexplore
from kvexplore import Generator, PagedCache, PreallocatedCache
from kvexplore.cli import main
from kvexplore.trace.textview import cache_map, step_view


def test_preallocated_map_follows_the_narrow_windows(tiny):
    gen = Generator(tiny, PreallocatedCache(tiny.config, 12))
    first = gen.prefill([1, 5, 6, 7, 8])
    assert cache_map(gen.cache.inspect.slot_view(), {0, 1, 2, 3, 4}) == "|+++++.......|"
    second = gen.step()  # writes position 5: narrow(2, 5, 1); reads narrow(2, 0, 6)
    lines = step_view(second, gen.cache.inspect.slot_view(), tiny.config.num_layers).splitlines()
    assert lines[0].startswith("#1    decode  fed 5..5 -> ") and lines[0].endswith(f"at 6 (p={second.prob:.2f})")
    assert "|=====+......|  6/12 slots  reserved 6.0 KiB  logical 3.0 KiB  written 512 B  copied 0 B" in lines[1]
    gen.run(3, stop_at_eos=False)
    gen.rewind(3)  # exllama-style rewind: slots 6..8 keep their data but are stale
    assert cache_map(gen.cache.inspect.slot_view(), set()) == "|======~~~...|"
    assert first.memory.written_bytes == 5 * kvexplore.kv_bytes(tiny.config, 1)


def test_wide_caches_are_grouped(tiny):
    cache = PreallocatedCache(tiny.config, 300)
    tiny(torch.tensor([list(range(3, 13))]), cache, 0)
    line = cache_map(cache.inspect.slot_view(), set(range(8, 10)), width=96)
    assert line == "|==+" + "." * 72 + "| 1 symbol = 4 slots"  # 300 slots in 75 groups of 4; written wins


def test_shared_pages_show_their_sharers(tiny):
    cache = PagedCache(tiny.config, num_blocks=4, block_size=4)
    tiny(torch.tensor([[1, 5, 6, 7, 8, 9]]), cache, 0)
    twin = cache.fork()
    assert cache_map(twin.inspect.slot_view(), set()) == "|222222..........|"


def test_cli_trace(checkpoint, capsys):
    source = str(checkpoint("llama-gqa2")[0])
    assert main(["generate", source, "--prompt", "Call me", "--max-new-tokens", "3", "--no-stop", "--trace",
                 "--max-seq-len", "40"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("cache map, one symbol per slot: . free  = filled/read  + written this step")
    maps = re.findall(r"layers 0-1  \|([.=+~x2-9*]+)\|", out)
    assert len(maps) == 3 and maps[0].count("+") > 1 and maps[1].count("+") == maps[2].count("+") == 1
    assert [m.count("=") + m.count("+") for m in maps] == [len(maps[0].rstrip(".")) + i for i in range(3)]


def test_one_line_per_kind_of_layer_cache(tmp_path):
    from helpers import make_checkpoint

    types = ["sliding_attention"] * 2 + ["full_attention"] + ["sliding_attention"] * 2 + ["full_attention"]
    make_checkpoint(tmp_path, "gemma4", layers=6, sliding_window=4, layer_types=types)
    model = kvexplore.load(tmp_path)
    gen = Generator(model, PreallocatedCache(model.config, 12))
    gen.prefill([1, 5, 6, 7, 8, 9])
    lines = step_view(gen.step(), gen.cache.inspect.slot_views(), model.config.num_layers).splitlines()
    assert lines[1].startswith("  layers 0,1,3  |==+=|  4/4 slots  reserved ")  # rings of the window, then memory
    assert lines[2].startswith("  layer 2  |======+.....|  7/12 slots") and "reserved" not in lines[2]  # full
    assert (lines[3] == "  layer 4    stores nothing, reads layer 3"
            and lines[4] == "  layer 5    stores nothing, reads layer 2")
