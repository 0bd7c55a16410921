"""The hostile-input sweep: every damaged file and every misuse gets a kvexplore error (or, for harmless damage, a
clean load), in a sandboxed process with a timeout and a memory limit: no foreign traceback, no hang, no crash,
and a refused call changes nothing."""

from __future__ import annotations

import collections

import pytest

import hostile_cases
import sandbox
from gguf_writer import write_gguf
from helpers import make_checkpoint


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    from test_tokenizer import byte_level_bpe

    base = tmp_path_factory.mktemp("pristine")
    folder, sharded, root = base / "folder", base / "sharded", tmp_path_factory.mktemp("damaged")
    ref = make_checkpoint(folder, "llama")
    make_checkpoint(sharded, "llama", shard_bytes="60KB", tokenizer=False)
    bpe = byte_level_bpe(bos_post_processor=False)
    bpe_ref = make_checkpoint(base / "bpe", "llama", vocab_size=bpe.get_vocab_size(), tokenizer=False)

    def rewrite(dst, edit, bpe_tokenizer=False):
        if bpe_tokenizer:
            return write_gguf(dst, bpe_ref, bpe_tokenizer=bpe, edit=edit)
        return write_gguf(dst, ref, spm_model=folder / "tokenizer.model", edit=edit)

    gguf_path = rewrite(base / "m.gguf", None)
    bpe_gguf = rewrite(base / "bpe.gguf", None, True)
    cases = hostile_cases.build_corpus(root, folder, sharded, gguf_path, bpe_gguf,
                                       lambda dst, edit, bpe=False: rewrite(dst, edit, bpe))
    return folder, gguf_path, bpe_gguf, cases


def report(results):
    kinds = collections.Counter(r.kind for r in results)
    slowest = max(results, key=lambda r: r.seconds)
    print(f"\n{len(results)} cases: {dict(kinds)}; slowest {slowest.name} {slowest.seconds:.2f} s")
    return kinds


@pytest.mark.long  # three files, each in a subprocess
def test_the_pristine_files_load_and_generate(corpus):
    folder, gguf_path, bpe_gguf, _ = corpus
    results = sandbox.run([(str(p), hostile_cases.load_and_generate, (str(p),)) for p in (folder, gguf_path, bpe_gguf)])
    assert [r.kind for r in results] == ["ok"] * 3, [r.outcome for r in results]


@pytest.mark.long  # 150 damaged files, each in a subprocess
def test_every_damaged_file_gets_a_kvexplore_error(corpus):
    *_, cases = corpus
    assert len(cases) >= 150
    results = sandbox.run([(name, hostile_cases.load_and_generate, (str(path),)) for name, path, _ in cases])
    kinds = report(results)
    bad = [f"{name}: {r.outcome[:600]}" for (name, path, expect), r in zip(cases, results)
           if r.kind not in ("ok", "kvx") or (expect == hostile_cases.ERROR and r.kind != "kvx")]
    assert not bad, "\n\n".join(bad)
    # every error names the damaged file or folder, so the user knows what to fix
    unnamed = [f"{name}: {r.outcome}" for (name, path, _), r in zip(cases, results)
               if r.kind == "kvx" and path.name not in r.outcome]
    assert not unnamed, "\n".join(unnamed)
    assert kinds["kvx"] >= 150


@pytest.mark.long  # 50 misuses, each in a subprocess
def test_every_misuse_is_refused_and_changes_nothing(corpus):
    folder, *_ = corpus
    names = list(hostile_cases.MISUSES)
    assert len(names) >= 50
    results = sandbox.run([(n, hostile_cases.misuse, (str(folder), n)) for n in names])
    report(results)
    bad = [f"{n}: {r.outcome[:800]}" for n, r in zip(names, results) if r.kind != "kvx"]
    assert not bad, "\n\n".join(bad)


@pytest.mark.long  # two loads, each in a subprocess
def test_nonfinite_weights_load_when_allowed(corpus):
    *_, cases = corpus
    nan = next(path for name, path, _ in cases if name == "safetensors tensor nan")
    [refused, allowed] = sandbox.run([("refused", hostile_cases.load_and_generate, (str(nan),)),
                                      ("allowed", hostile_cases.load_and_generate, (str(nan), True))])
    assert refused.outcome.startswith("kvx:NonFiniteWeightsError:") and "allow_nonfinite=True" in refused.outcome
    # loaded on purpose, the NaN reaches the logits and the step says so instead of emitting a token
    assert allowed.outcome.startswith(("ok:", "kvx:StepError:")), allowed.outcome
