"""The hostile-input sweep's damaged files: damaged copies of a model folder, a sharded folder and GGUF files.

:func:`build_corpus` writes them (in the test process); :func:`load_and_generate` loads one and generates inside a
sandboxed child (see ``sandbox.py``). Each corruption says what it may give: ``"error"`` (a kvexplore error must be
raised) or ``"any"`` (harmless damage, such as a bit flip inside a weight: a clean load or a kvexplore error).
"""

from __future__ import annotations

import json
import math
import random
import shutil
import struct
from pathlib import Path

ERROR, ANY = "error", "any"


# -- run in the child ----------------------------------------------------------------------------------------------
def load_and_generate(path: str, allow_nonfinite: bool = False) -> str:
    import kvexplore

    model = kvexplore.load(path, allow_nonfinite=allow_nonfinite)
    gen = kvexplore.Generator(model, kvexplore.make_cache("preallocated", model, max_seq_len=32))
    gen.prefill("The cache keeps" if model.tokenizer is not None else [1, 5, 9])
    gen.run(3)
    if model.tokenizer is not None:
        model.tokenizer.decode(gen.tokens)
    return f"{len(gen.tokens)} tokens"


# -- built in the test process ---------------------------------------------------------------------------------------
def build_corpus(root: Path, folder: Path, sharded: Path, gguf_path: Path, bpe_gguf: Path,
                 rewrite_gguf) -> list[tuple[str, Path, str]]:
    """Every damaged copy of the pristine ``folder`` (safetensors + sentencepiece), ``sharded`` (a shard index),
    and GGUF files, under ``root``. ``rewrite_gguf(dst, edit)`` writes the GGUF again with ``edit(writer)``."""
    cases: list[tuple[str, Path, str]] = []
    rng = random.Random(0)

    def copy(name: str, src: Path = folder) -> Path:
        dst = root / f"case{len(cases):03d}"
        shutil.copytree(src, dst)
        return dst

    def add(name: str, path: Path, expect: str = ERROR) -> None:
        cases.append((name, path, expect))

    # config.json: each field, each kind of wrong value
    config = json.loads((folder / "config.json").read_text())
    bad_values = {"str": "abc", "null": None, "nan": math.nan, "list": [1], "negative": -1, "zero": 0,
                  "huge": 10 ** 12, "fraction": 64.5, "string bool": "false", "bool": True, "object": {}}
    fields = ["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta", "max_position_embeddings",
              "tie_word_embeddings", "bos_token_id", "eos_token_id", "attention_bias"]
    for field in fields:
        for label, value in bad_values.items():
            dst = copy(f"config {field}={label}")
            raw = dict(config)
            if field == "rope_theta" and "rope_parameters" in raw:
                raw["rope_parameters"] = {**raw["rope_parameters"], "rope_theta": value}
            else:
                raw[field] = value
            (dst / "config.json").write_text(json.dumps(raw))
            # a null optional field falls back to its default; every other value here is wrong
            harmless = label == "null" and field in ("num_key_value_heads", "head_dim", "rms_norm_eps",
                                                     "max_position_embeddings", "tie_word_embeddings",
                                                     "bos_token_id", "eos_token_id", "attention_bias")
            valid = (field, label) in {("rope_theta", "huge"), ("rope_theta", "fraction"), ("bos_token_id", "zero"),
                                       ("tie_word_embeddings", "bool"), ("eos_token_id", "list"),
                                       ("eos_token_id", "zero")}  # legal values, just not the saved ones
            add(f"config {field}={label}", dst, ANY if harmless or valid else ERROR)
    num_layers = config["num_hidden_layers"]
    for label, text in {
        "top-level list": "[1, 2]", "top-level string": '"config"', "empty": "", "truncated": json.dumps(config)[:40],
        "deeply nested": "[" * 100000 + "]" * 100000,
        "layers 10^9": json.dumps({**config, "num_hidden_layers": 10 ** 9}),
        "layers one more": json.dumps({**config, "num_hidden_layers": num_layers + 1}),
        "layers one fewer": json.dumps({**config, "num_hidden_layers": num_layers - 1}),
        "architecture unknown": json.dumps({**config, "architectures": ["GPT2LMHeadModel"]}),
        "architecture not str": json.dumps({**config, "architectures": [5]}),
        "no architecture": json.dumps({k: v for k, v in config.items() if k not in ("architectures", "model_type")}),
        "no vocab_size": json.dumps({k: v for k, v in config.items() if k != "vocab_size"}),
        "rope string": json.dumps({**config, "rope_scaling": "linear", "rope_parameters": None}),
        "rope no factor": json.dumps({**config, "rope_parameters": {"rope_type": "linear", "rope_theta": 1e4}}),
        "rope llama3 partial": json.dumps({**config, "rope_parameters": {"rope_type": "llama3", "factor": 8.0,
                                                                         "rope_theta": 1e4}}),
        "rope longrope": json.dumps({**config, "rope_parameters": {"rope_type": "longrope", "factor": 4.0,
                                                                   "rope_theta": 1e4}}),
        "rope yarn no factor": json.dumps({**config, "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4}}),
        "rope factor zero": json.dumps({**config, "rope_parameters": {"rope_type": "linear", "factor": 0,
                                                                      "rope_theta": 1e4}}),
        "rope theta big": json.dumps({**config, "rope_parameters": {"rope_type": "default", "rope_theta": "big"}}),
        "heads not dividing": json.dumps({**config, "num_attention_heads": 3, "head_dim": None}),
        "kv heads not dividing": json.dumps({**config, "num_key_value_heads": 3}),
        "eps negative": json.dumps({**config, "rms_norm_eps": -1}),
    }.items():
        dst = copy(f"config {label}")
        (dst / "config.json").write_text(text)
        add(f"config {label}", dst)
    dst = copy("config not utf-8")
    (dst / "config.json").write_bytes(b'{"vocab_size": "\xff\xfe"}')
    add("config not utf-8", dst)
    dst = copy("config missing")
    (dst / "config.json").unlink()
    add("config missing", dst)

    # safetensors: truncations, header damage, bit flips in the data
    weights = (folder / "model.safetensors").read_bytes()
    (header_len,) = struct.unpack("<Q", weights[:8])
    for frac in (0.0, 0.001, 0.01, 0.1, 0.5, 0.9, 0.999):
        dst = copy(f"safetensors truncated {frac}")
        (dst / "model.safetensors").write_bytes(weights[: max(0, int(len(weights) * frac))])
        add(f"safetensors truncated {frac}", dst)
    for label, data in {"header length huge": struct.pack("<Q", 1 << 60) + weights[8:],
                        "header length zero": struct.pack("<Q", 0) + weights[8:],
                        "header not json": weights[:8] + b"x" * header_len + weights[8 + header_len:],
                        "empty file": b""}.items():
        dst = copy(f"safetensors {label}")
        (dst / "model.safetensors").write_bytes(data)
        add(f"safetensors {label}", dst)
    for i in range(8):
        at = rng.randrange(8, 8 + header_len)
        dst = copy(f"safetensors header bit flip {at}")
        data = bytearray(weights)
        data[at] ^= 1 << rng.randrange(8)
        (dst / "model.safetensors").write_bytes(bytes(data))
        add(f"safetensors header bit flip {at}", dst, ANY)  # a flip inside a name or a digit may still parse
    for i in range(6):
        at = rng.randrange(8 + header_len, len(weights))
        dst = copy(f"safetensors data bit flip {at}")
        data = bytearray(weights)
        data[at] ^= 1 << rng.randrange(8)
        (dst / "model.safetensors").write_bytes(bytes(data))
        add(f"safetensors data bit flip {at}", dst, ANY)  # a changed weight, or an Inf/NaN the loader refuses
    import torch
    from safetensors.torch import load_file, save_file

    tensors = load_file(folder / "model.safetensors")
    first = sorted(tensors)[0]
    for label, change in {
        "tensor missing": lambda t: t.pop("model.norm.weight"),
        "tensor extra": lambda t: t.__setitem__("model.extra.weight", torch.zeros(2)),
        "tensor wrong shape": lambda t: t.__setitem__("model.norm.weight", torch.zeros(3)),
        "tensor integer": lambda t: t.__setitem__("model.norm.weight", t["model.norm.weight"].to(torch.int32)),
        "tensor nan": lambda t: t[first].view(-1).__setitem__(0, float("nan")),
        "tensor inf": lambda t: t[first].view(-1).__setitem__(3, float("inf")),
        "layer missing": lambda t: [t.pop(n) for n in list(t) if n.startswith("model.layers.1.")],
        "layer renumbered": lambda t: [t.__setitem__(n.replace("layers.1.", "layers.5."), t.pop(n))
                                       for n in list(t) if n.startswith("model.layers.1.")],
    }.items():
        dst = copy(f"safetensors {label}")
        changed = {k: v.clone() for k, v in tensors.items()}
        change(changed)
        save_file(changed, dst / "model.safetensors", metadata={"format": "pt"})
        add(f"safetensors {label}", dst)
    dst = copy("weights missing")
    (dst / "model.safetensors").unlink()
    add("weights missing", dst)

    # the shard index
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    wrong = dict(index["weight_map"])
    name = next(n for n, f in wrong.items() if f == shards[0])
    wrong[name] = shards[1]
    for label, text in {
        "index not json": "{", "index a list": "[]", "index no weight_map": json.dumps({"metadata": {}}),
        "index weight_map list": json.dumps({"weight_map": [1]}),
        "index file missing": json.dumps({"weight_map": {**index["weight_map"], name: "nope.safetensors"}}),
        "index path outside": json.dumps({"weight_map": {**index["weight_map"], name: "../x.safetensors"}}),
        "index wrong shard": json.dumps({"weight_map": wrong}),
        "index value number": json.dumps({"weight_map": {**index["weight_map"], name: 3}}),
    }.items():
        dst = copy(f"shards {label}", sharded)
        (dst / "model.safetensors.index.json").write_text(text)
        add(f"shards {label}", dst)
    dst = copy("shards one shard truncated", sharded)
    shard = dst / shards[0]
    shard.write_bytes(shard.read_bytes()[:200])
    add("shards one shard truncated", dst)

    # tokenizer files
    sp = (folder / "tokenizer.model").read_bytes()
    for label, data in {"truncated": sp[: len(sp) // 2], "garbage": b"\x00\x01garbage" * 10, "empty": b""}.items():
        dst = copy(f"tokenizer.model {label}")
        (dst / "tokenizer.model").write_bytes(data)
        add(f"tokenizer.model {label}", dst)
    for label, (file, content) in {
        "tokenizer_config list": ("tokenizer_config.json", "[1]"),
        "tokenizer_config not json": ("tokenizer_config.json", "{"),
        "tokenizer_config bos number": ("tokenizer_config.json", json.dumps({"bos_token": 5})),
        "tokenizer_config bos dict number": ("tokenizer_config.json", json.dumps({"bos_token": {"content": 5}})),
        "tokenizer_config add_bos string": ("tokenizer_config.json", json.dumps({"add_bos_token": "yes"})),
        "tokenizer_config template number": ("tokenizer_config.json", json.dumps({"chat_template": 5})),
        "tokenizer_config template list": ("tokenizer_config.json", json.dumps({"chat_template": [{"x": 1}]})),
        "generation_config list": ("generation_config.json", "[]"),
        "generation_config eos string": ("generation_config.json", json.dumps({"eos_token_id": "2"})),
        "generation_config eos past vocab": ("generation_config.json", json.dumps({"eos_token_id": 99999})),
        "generation_config bos negative": ("generation_config.json", json.dumps({"bos_token_id": -1})),
        "generation_config eos list of str": ("generation_config.json", json.dumps({"eos_token_id": ["a"]})),
        "tokenizer.json garbage": ("tokenizer.json", "{not json"),
        "tokenizer.json wrong model": ("tokenizer.json", json.dumps({"model": {"type": "Nope"}})),
        "chat_template.jinja not utf-8": ("chat_template.jinja", b"\xff\xfe{{"),
    }.items():
        dst = copy(label)
        target = dst / file
        target.write_bytes(content) if isinstance(content, bytes) else target.write_text(content)
        add(label, dst)

    # GGUF: truncations and bit flips
    data = gguf_path.read_bytes()
    for i, frac in enumerate((0.0, 0.0001, 0.001, 0.003, 0.01, 0.05, 0.1, 0.3, 0.6, 0.9, 0.999)):
        dst = root / f"case{len(cases):03d}.gguf"
        dst.write_bytes(data[: int(len(data) * frac)])
        add(f"gguf truncated {frac}", dst)
    meta_end = data.find(b"token_embd.weight")  # tensor infos follow the metadata
    for i in range(12):
        at = rng.randrange(0, meta_end)
        dst = root / f"case{len(cases):03d}.gguf"
        flipped = bytearray(data)
        flipped[at] ^= 1 << rng.randrange(8)
        dst.write_bytes(bytes(flipped))
        add(f"gguf metadata bit flip {at}", dst, ANY)
    for i in range(3):
        at = rng.randrange(len(data) - 4096, len(data))
        dst = root / f"case{len(cases):03d}.gguf"
        flipped = bytearray(data)
        flipped[at] ^= 1 << rng.randrange(8)
        dst.write_bytes(bytes(flipped))
        add(f"gguf data bit flip {at}", dst, ANY)

    # GGUF: values patched in place
    def patch(label: str, key: bytes, fmt: str, value, skip: int = 0, expect: str = ERROR) -> None:
        at = data.find(struct.pack("<Q", len(key)) + key)
        assert at > 0, key
        at += 8 + len(key) + skip
        patched = bytearray(data)
        struct.pack_into("<" + fmt, patched, at, value)
        dst = root / f"case{len(cases):03d}.gguf"
        dst.write_bytes(bytes(patched))
        add(f"gguf {label}", dst, expect)

    u32 = 4  # the value type (u32) sits between a key and its value
    patch("block_count 10^9", b"llama.block_count", "I", 10 ** 9, u32)
    patch("block_count 0", b"llama.block_count", "I", 0, u32)
    patch("block_count one more", b"llama.block_count", "I", num_layers + 1, u32)
    patch("head_count 0", b"llama.attention.head_count", "I", 0, u32)
    patch("head_count 3", b"llama.attention.head_count", "I", 3, u32)
    patch("embedding_length 0", b"llama.embedding_length", "I", 0, u32)
    patch("context_length 0", b"llama.context_length", "I", 0, u32)
    patch("rms eps -1", b"llama.attention.layer_norm_rms_epsilon", "f", -1.0, u32)
    patch("rms eps nan", b"llama.attention.layer_norm_rms_epsilon", "f", math.nan, u32)
    patch("freq_base 0", b"llama.rope.freq_base", "f", 0.0, u32)
    patch("bos past vocab", b"tokenizer.ggml.bos_token_id", "I", 99999, u32)
    patch("eos past vocab", b"tokenizer.ggml.eos_token_id", "I", 99999, u32)
    patch("value type unknown", b"llama.block_count", "I", 77)
    patch("key length huge", b"llama.block_count", "Q", 1 << 62, -len(b"llama.block_count") - 8)
    for key in (b"tokenizer.ggml.tokens", b"tokenizer.ggml.scores", b"tokenizer.ggml.token_type"):
        patch(f"{key.decode()} count 2^60", key, "Q", 1 << 60, u32 + 4)
        count_at = data.find(struct.pack("<Q", len(key)) + key) + 8 + len(key) + 8
        patch(f"{key.decode()} count +1", key, "Q", struct.unpack_from("<Q", data, count_at)[0] + 1, u32 + 4)
    patch("token_type element 99", b"tokenizer.ggml.token_type", "i", 99, u32 + 4 + 8)
    patch("array element type unknown", b"tokenizer.ggml.scores", "I", 77, u32)
    tname = b"blk.0.attn_q.weight"
    tat = data.find(tname, meta_end - 1)
    for label, fmt, value, skip in (("n_dims 9", "I", 9, 0), ("dim huge", "Q", 1 << 40, 4),
                                    ("type unknown", "I", 99, 4 + 16), ("offset huge", "Q", 1 << 50, 4 + 16 + 4)):
        patched = bytearray(data)
        struct.pack_into("<" + fmt, patched, tat + len(tname) + skip, value)
        dst = root / f"case{len(cases):03d}.gguf"
        dst.write_bytes(bytes(patched))
        add(f"gguf tensor {label}", dst)

    # GGUF: metadata rewritten with other types or contents
    from gguf import GGUFValueType as V

    def put(key, value, vtype, sub=None):
        return lambda w: w.add_key_value(key, value, vtype, sub)

    def drop(key):
        return lambda w: w.kv_data[0].pop(key)

    def tokens_edit(fn):
        def edit(w):
            v = w.kv_data[0]["tokenizer.ggml.tokens"]
            w.add_key_value("tokenizer.ggml.tokens", fn(list(v.value)), V.ARRAY, V.STRING)
        return edit

    def scores_short(w):
        v = w.kv_data[0]["tokenizer.ggml.scores"]
        w.add_key_value("tokenizer.ggml.scores", list(v.value)[:-5], V.ARRAY, V.FLOAT32)

    def scores_nan(w):
        v = list(w.kv_data[0]["tokenizer.ggml.scores"].value)
        v[7] = math.nan
        w.add_key_value("tokenizer.ggml.scores", v, V.ARRAY, V.FLOAT32)

    for label, edit in {
        "head_count string": put("llama.attention.head_count", "four", V.STRING),
        "block_count float": put("llama.block_count", 2.5, V.FLOAT32),
        "block_count missing": drop("llama.block_count"),
        "architecture unknown": put("general.architecture", "bert", V.STRING),
        "architecture number": put("general.architecture", 7, V.UINT32),
        "tokenizer model unknown": put("tokenizer.ggml.model", "bert", V.STRING),
        "tokenizer tokens missing": drop("tokenizer.ggml.tokens"),
        "tokens not strings": put("tokenizer.ggml.tokens", [1, 2, 3], V.ARRAY, V.UINT32),
        "token invalid utf-8": tokens_edit(lambda t: [b"\xff\xfe" if i == 10 else x for i, x in enumerate(t)]),
        "token duplicated": tokens_edit(lambda t: [t[5] if i == 6 else x for i, x in enumerate(t)]),
        "scores short": scores_short,
        "scores nan": scores_nan,
        "scores strings": put("tokenizer.ggml.scores", ["a"] * 5, V.ARRAY, V.STRING),
        "rope scaling yarn": put("llama.rope.scaling.type", "yarn", V.STRING),
        "rope scaling linear no factor": put("llama.rope.scaling.type", "linear", V.STRING),
        "add_bos string": put("tokenizer.ggml.add_bos_token", "yes", V.STRING),
        "chat template number": put("tokenizer.chat_template", 5, V.UINT32),
        "alignment 3": put("general.alignment", 3, V.UINT32),
    }.items():
        dst = root / f"case{len(cases):03d}.gguf"
        rewrite_gguf(dst, edit)
        add(f"gguf {label}", dst)

    # the BPE (gpt2) tokenizer of a GGUF
    def merges_edit(fn):
        def edit(w):
            v = w.kv_data[0]["tokenizer.ggml.merges"]
            w.add_key_value("tokenizer.ggml.merges", fn(list(v.value)), V.ARRAY, V.STRING)
        return edit

    for label, edit in {
        "merge of unknown tokens": merges_edit(lambda m: ["zzqq xxyy", *m[1:]]),
        "merge without space": merges_edit(lambda m: ["abc", *m[1:]]),
        "pre-tokenizer unknown": put("tokenizer.ggml.pre", "nope", V.STRING),
        "merges not strings": put("tokenizer.ggml.merges", [1, 2], V.ARRAY, V.UINT32),
    }.items():
        dst = root / f"case{len(cases):03d}.gguf"
        rewrite_gguf(dst, edit, True)
        add(f"gguf bpe {label}", dst)
    dst = root / f"case{len(cases):03d}.gguf"
    dst.write_bytes(b"not a gguf file at all, just text" * 4)
    add("gguf not gguf", dst)
    add("gguf missing", root / "missing.gguf")
    return cases
