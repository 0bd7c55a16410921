"""kvexplore against the transformers reference: same weights, same ids, same logits and greedy tokens."""

import shutil

import pytest
import torch

import kvexplore
from conftest import VARIANTS
from helpers import ARCHITECTURES, make_checkpoint, no_cache_logits

TOL = 1e-4


def reference_logits(ref, ids):
    with torch.no_grad():
        return ref(torch.tensor([ids])).logits[0].float()


def cached_logits(model, ids, prefill_len):
    """Prefill ``ids[:prefill_len]`` in one pass, then decode the rest one token at a time."""
    cache = kvexplore.PreallocatedCache(model.config, len(ids), dtype=model.dtype)
    out = [model(torch.tensor([ids[:prefill_len]]), cache, 0)[0]]
    for pos in range(prefill_len, len(ids)):
        out.append(model(torch.tensor([[ids[pos]]]), cache, pos)[0])
    assert cache.length == len(ids)
    return torch.cat(out)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_logits_match_transformers(checkpoint, name):
    folder, ref = checkpoint(name)
    model = kvexplore.load(folder)
    ids = torch.randint(0, model.config.vocab_size, (48,), generator=torch.Generator().manual_seed(1)).tolist()
    want = reference_logits(ref, ids)
    got = cached_logits(model, ids, prefill_len=20)
    assert got.shape == want.shape == (48, model.config.vocab_size)
    assert (got - want).abs().max().item() < TOL
    # a chunked prefill at a non-zero position takes the explicit-mask path and must agree too
    cache = kvexplore.PreallocatedCache(model.config, 48)
    model(torch.tensor([ids[:16]]), cache, 0)
    chunk = model(torch.tensor([ids[16:40]]), cache, 16)[0]
    assert (chunk - want[16:40]).abs().max().item() < TOL


@pytest.mark.parametrize("name", list(VARIANTS))
def test_64_greedy_tokens_match_transformers(checkpoint, name):
    folder, ref = checkpoint(name)
    model = kvexplore.load(folder)
    prompt = model.tokenizer.encode("Call me Ishmael. Some years ago")
    prompt = [model.tokenizer.bos_id, *prompt]
    ref.generation_config.eos_token_id = None  # generate exactly 64 tokens, as kvexplore does below
    with torch.no_grad():
        out = ref.generate(torch.tensor([prompt]), max_new_tokens=64, do_sample=False, pad_token_id=0)
    want = out[0, len(prompt):].tolist()
    gen = kvexplore.Generator(model, kvexplore.PreallocatedCache(model.config, 128))
    gen.prefill(prompt)
    gen.run(63, stop_at_eos=False)
    assert len(want) == 64
    assert gen.generated_tokens == want


def test_rope_scaling_is_applied(checkpoint, tmp_path):
    """The parity above would be vacuous if scaling changed nothing at these positions."""
    folder, ref = checkpoint("llama3-rope-tied")
    plain = tmp_path / "plain"
    shutil.copytree(folder, plain)
    cfg = (plain / "config.json").read_text().replace('"llama3"', '"default"')
    (plain / "config.json").write_text(cfg)
    ids = list(range(3, 43))
    want = reference_logits(ref, ids)
    wrong = cached_logits(kvexplore.load(plain), ids, prefill_len=10)
    assert (wrong - want).abs().max().item() > 100 * TOL


def test_sharded_checkpoint(tmp_path):
    ref = make_checkpoint(tmp_path, "llama", layers=3, shard_bytes="60KB")
    shards = sorted(p.name for p in tmp_path.glob("model-*.safetensors"))
    assert len(shards) > 1 and (tmp_path / "model.safetensors.index.json").exists()
    model = kvexplore.load(tmp_path)
    ids = list(range(5, 37))
    assert (cached_logits(model, ids, 8) - reference_logits(ref, ids)).abs().max().item() < TOL


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_close_to_float32(checkpoint, dtype):
    folder, ref = checkpoint("llama-gqa2")
    model = kvexplore.load(folder, dtype=dtype)
    assert model.dtype == dtype and model.model.layers[0].self_attn.q_proj.weight.dtype == dtype
    ids = list(range(3, 35))
    want = reference_logits(ref, ids)
    got = cached_logits(model, ids, 8)
    scale = want.abs().max().item()
    assert (got - want).abs().max().item() < 0.05 * scale
    assert (got.argmax(-1) == want.argmax(-1)).float().mean().item() > 0.9


def test_sliding_window_matches_transformers(tmp_path):
    """Mistral's sliding window: past the window, queries must stop seeing the oldest keys."""
    ref = make_checkpoint(tmp_path, "mistral", sliding_window=8)
    model = kvexplore.load(tmp_path)
    assert model.config.sliding_window == 8
    ids = list(range(3, 33))
    want = reference_logits(ref, ids)
    got = cached_logits(model, ids, 12)
    assert (got - want).abs().max().item() < TOL
    unwindowed = tmp_path / "unwindowed"
    shutil.copytree(tmp_path, unwindowed, ignore=shutil.ignore_patterns("unwindowed"))
    cfg = (unwindowed / "config.json").read_text().replace('"sliding_window": 8', '"sliding_window": null')
    (unwindowed / "config.json").write_text(cfg)
    full = cached_logits(kvexplore.load(unwindowed), ids, 12)
    assert (full[:8] - want[:8]).abs().max().item() < TOL  # inside the window nothing changes
    assert (full[8:] - want[8:]).abs().max().item() > 100 * TOL


def test_cpu_weights_keep_the_layout_their_one_token_products_read_fastest(checkpoint, monkeypatch):
    """Column-major as loaded (MKL's fast layout for F.linear; see benchmarks/decode_speed.py), row-major (the file's
    own) once the one-row kernels are applied (kvexplore.fast.kernels); values unchanged, tied weights still tied."""
    from safetensors.torch import load_file
    from kvexplore.fast import kernels

    monkeypatch.setenv("KVEXPLORE_PRODUCTS", "kernels")  # every width on its kernel, whatever the timing says here

    folder, _ = checkpoint("qwen2-gqa8")
    model = kvexplore.load(folder)
    saved = load_file(folder / "model.safetensors")
    for kernel in (False, True):
        if kernel and not kernels.apply(model):
            pytest.skip(kernels.status())
        q = model.model.layers[0].self_attn.q_proj.weight
        emb = model.model.embed_tokens.weight  # tied: it is also the output head
        for w in (q, emb):
            assert w.stride() == ((w.shape[1], 1) if kernel else (1, w.shape[0]))
        assert torch.equal(q, saved["model.layers.0.self_attn.q_proj.weight"])
        assert model.head_weight is emb and model.model.norm.weight.is_contiguous()
    kernels.remove(model)  # F.linear's layout again
    assert model.model.embed_tokens.weight.stride() == (1, model.model.embed_tokens.weight.shape[0])


def test_last_only_logits(tiny):
    ids = torch.tensor([[3, 4, 5, 6, 7]])
    full = no_cache_logits(tiny, ids, batched=True)
    last = no_cache_logits(tiny, ids, last_only=True, batched=True)
    assert last.shape == (1, 1, tiny.config.vocab_size) and torch.allclose(last[0, 0], full[0, -1], atol=1e-5)


def test_half_precision_weights_stay_row_major(checkpoint):
    folder, _ = checkpoint("qwen2-gqa8")
    q = kvexplore.load(folder, dtype=torch.bfloat16).model.layers[0].self_attn.q_proj.weight
    assert q.is_contiguous()


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_every_registered_architecture_matches_its_transformers_class(zoo, arch):
    """Each entry of the architecture registry, built from its own small example against the transformers class it
    declares: prefill and decode logits within 1e-4 (a new family module is checked without editing this file)."""
    folder, ref = zoo.checkpoint(arch, tokenizer=False)
    model = kvexplore.load(folder)
    assert type(ref).__name__ == model.config.architecture
    ids = torch.randint(0, model.config.vocab_size, (14,), generator=torch.Generator().manual_seed(3)).tolist()
    want = reference_logits(ref, ids)
    assert (cached_logits(model, ids, prefill_len=9) - want).abs().max().item() < TOL
