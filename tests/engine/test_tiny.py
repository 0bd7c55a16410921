"""The embedded tiny model: shipped in the package, small, a real (trained) model whose card tells the truth."""

import re
from pathlib import Path

import pytest
import torch

import kvexplore
from kvexplore.formats import store

CHAPTER_135 = (Path(__file__).resolve().parents[1] / "data" / "moby_dick_chapter_135.txt").read_text()


@pytest.fixture(scope="module")
def tiny_model(trained):
    return trained


def test_files_are_in_the_package_and_small():
    folder = store.model_path("tiny")
    assert folder == Path(kvexplore.__file__).parent / "data" / "tiny"
    names = sorted(p.name for p in folder.iterdir())
    assert names == ["MODEL_CARD.md", "config.json", "model.safetensors", "tokenizer.model", "tokenizer_config.json"]
    assert store.size_on_disk("tiny") < 10_000_000 and store.is_present("tiny")


def test_config_is_a_small_gqa_llama(tiny_model):
    c = tiny_model.config
    assert c.architecture == "LlamaForCausalLM" and 4 <= c.num_layers <= 8 and 256 <= c.hidden_size <= 384
    assert c.num_kv_heads == 2 and c.kv_groups > 1 and 4000 <= c.vocab_size <= 8192
    assert tiny_model.tokenizer.kind == "sentencepiece" and tiny_model.tokenizer.add_bos


@pytest.mark.long  # the fast tier's heaviest (1-3 s): the tiny model's perplexity
def test_held_out_perplexity_is_what_the_card_says(tiny_model):
    card = (store.model_path("tiny") / "MODEL_CARD.md").read_text()
    stated = float(re.search(r"held-out perplexity, chapter 135\*\* \| \*\*([\d.]+)\*\*", card)[1])
    tok = tiny_model.tokenizer
    measured = kvexplore.perplexity(tiny_model, [tok.bos_id, *tok.encode(CHAPTER_135)], window=256)
    assert measured <= stated + 0.01
    assert measured < 200  # a trained model: an untrained one scores about the vocabulary size (4096)


def test_generates_english_like_text(tiny_model):
    gen = kvexplore.Generator(tiny_model, kvexplore.PreallocatedCache(tiny_model.config, 64))
    gen.prefill("Call me Ishmael. Some years ago")
    gen.run(24, stop_at_eos=False)
    words = gen.text.split()
    assert len(words) >= 8 and sum(w.strip(".,;!?'\"-").isalpha() for w in words) >= len(words) // 2


def test_attention_is_not_uniform(tiny_model):
    """Its attention patterns are real: some heads focus sharply (a random model's heads are near uniform)."""
    probs = {}

    class Capture:
        def hook(self, name, t):
            if name.endswith("attn.probs"):
                probs[name] = t

        def wants_attention(self, layer):
            return True

    ids = [tiny_model.tokenizer.bos_id, *tiny_model.tokenizer.encode(CHAPTER_135[:600])]
    cache = kvexplore.PreallocatedCache(tiny_model.config, len(ids))
    tiny_model(torch.tensor([ids]), cache, 0, tracer=Capture())
    last_rows = torch.stack([p[0, :, -1] for p in probs.values()])  # (layers, heads, S) for the last token
    assert last_rows.max() > 0.5 and len(probs) == tiny_model.config.num_layers
