"""Both tokenizer backends: sentencepiece (tokenizer.model) and tokenizers (tokenizer.json), specials and chat."""

import json

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

import kvexplore
from helpers import TEXT, make_checkpoint

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def byte_level_bpe(bos_post_processor: bool) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(TEXT.splitlines(), trainer)
    if bos_post_processor:
        tok.post_processor = processors.TemplateProcessing(single="<|endoftext|> $A",
                                                           special_tokens=[("<|endoftext|>", 0)])
    return tok


@pytest.fixture(scope="module", params=[False, True], ids=["no-bos", "bos-by-post-processor"])
def json_model(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp("bpe")
    tok = byte_level_bpe(request.param)
    make_checkpoint(folder, "qwen2", vocab_size=tok.get_vocab_size() + 8, tokenizer=False, tied=True,
                    bos_token_id=0, eos_token_id=0)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>", "bos_token": "<|endoftext|>"}))
    (folder / "chat_template.jinja").write_text(CHATML)
    return kvexplore.load(folder), request.param


def test_tokenizer_json_roundtrip_and_specials(json_model):
    model, bos_by_post_processor = json_model
    tok = model.tokenizer
    assert tok.kind == "tokenizers"
    text = "Call me Ishmael, 12 345 — naïve 🐋"
    assert tok.decode(tok.encode(text)) == text
    assert tok.bos_id == 0 and tok.eos_ids == [0, 2]  # generation/config eos first, then the tokenizer's
    assert tok.add_bos is bos_by_post_processor
    assert tok.encode("<|im_start|>") == [1]  # special tokens in text map to their ids
    assert model.config.vocab_size == tok.vocab_size + 8  # a padded embedding is fine


def test_token_text_keeps_spaces(json_model):
    tok = json_model[0].tokenizer
    ids = tok.encode("the whale and the sea")
    pieces = [tok.token_text(i, ids[:n]) for n, i in enumerate(ids)]
    assert "".join(pieces) == "the whale and the sea"


def test_chatml_prompt(json_model):
    model, bos_by_post_processor = json_model
    tok = model.tokenizer
    text = tok.apply_chat_template([{"role": "user", "content": "What is a whale?"}])
    assert text == "<|im_start|>user\nWhat is a whale?<|im_end|>\n<|im_start|>assistant\n"
    ids = tok.encode_chat([{"role": "user", "content": "What is a whale?"}])
    assert ids[:2 if bos_by_post_processor else 1] == ([0, 1] if bos_by_post_processor else [1])
    gen = kvexplore.Generator(model, kvexplore.PreallocatedCache(model.config, 64))
    gen.prefill_chat([{"role": "user", "content": "What is a whale?"}])
    assert gen.prompt_tokens == ids


def test_sentencepiece_token_text(tiny):
    tok = tiny.tokenizer
    ids = tok.encode("Call me Ishmael. Some years ago")
    pieces = [tok.token_text(i, ids[:n]) for n, i in enumerate(ids)]
    assert "".join(pieces) == "Call me Ishmael. Some years ago"
    assert sum(p.startswith(" ") for p in pieces) == 5  # decode() alone would drop these word-initial spaces


def test_chat_template_error_is_readable(json_model):
    tok = json_model[0].tokenizer
    saved = tok.chat_template
    tok.chat_template = "{{ raise_exception('only user messages') }}"
    try:
        with pytest.raises(ValueError, match="chat template rejected the messages: only user messages"):
            tok.apply_chat_template([{"role": "system", "content": "x"}])
    finally:
        tok.chat_template = saved
