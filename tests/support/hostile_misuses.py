"""The hostile-input sweep's misuses of the Python API: each must raise a kvexplore error and leave the generator
exactly as it was (:func:`state`, :func:`same_state`). :func:`misuse` commits one inside a sandboxed child (see
``sandbox.py``); :data:`MISUSES` names them all.
"""

from __future__ import annotations

from pathlib import Path


def state(gen) -> tuple:
    """Everything a failed call must leave as it was: tokens, history, RNG, settings, the cache's length, slot
    map, memory report and every tensor it holds."""
    import torch

    cache = gen.cache
    tensors = [t.clone() for layer in range(gen.model.config.num_layers) for t in cache.inspect.storage(layer)]
    return (gen.tokens, [(r.step, r.token_id) for r in gen.history], gen._rng.get_state().clone(), gen.sampling,
            gen.top_candidates, gen.seed, cache.length, cache.inspect.slot_view(), cache.inspect.memory_report(),
            tensors, torch.get_rng_state().clone())


def same_state(a: tuple, b: tuple) -> bool:
    import torch

    def eq(x, y) -> bool:
        if isinstance(x, torch.Tensor):
            return x.shape == y.shape and torch.equal(x, y)
        if isinstance(x, list) and x and isinstance(x[0], torch.Tensor):
            return len(x) == len(y) and all(map(eq, x, y))
        return x == y

    return all(eq(x, y) for x, y in zip(a, b))


def misuse(folder: str, name: str) -> str:
    """Set up a generator mid-sequence on ``folder``'s model, commit misuse ``name``; raise its kvexplore error if
    nothing changed (an AssertionError if something did, or if the misuse was accepted)."""
    import kvexplore

    model = kvexplore.load(folder)
    kind, action = MISUSES[name]
    cache = kvexplore.make_cache(kind, model, max_seq_len=24) if kind not in ("concat", "none") else (
        kvexplore.make_cache(kind, model))
    gen = kvexplore.Generator(model, cache, seed=3, temperature=0.8, top_k=20)
    if name != "step before prefill":
        gen.prefill("The cache keeps the keys")
        gen.run(2)
    if name.startswith("cache full"):
        while gen.cache.length < gen.cache.capacity:
            gen.step()
    before = state(gen)
    try:
        action(gen, model, Path(folder))
    except kvexplore.KVExploreError as e:
        if not same_state(before, state(gen)):
            raise AssertionError(f"state changed after the refused misuse ({e})") from e
        still_steps(gen)
        raise
    raise AssertionError(f"misuse {name!r} was accepted")


def still_steps(gen) -> None:
    """After a refused call the generator still steps (unless it had no sequence)."""
    if gen.tokens and gen.cache.length + 1 < (gen.cache.capacity or 10 ** 9):
        gen.step()


def _set(attr: str, value):
    def action(gen, model, folder):
        setattr(gen, attr, value)
    return action


def _gen(**kw):
    def action(gen, model, folder):
        import kvexplore
        kvexplore.Generator(model, kvexplore.make_cache("preallocated", model, max_seq_len=8), **kw)
    return action


def _call(method: str, *args, **kw):
    def action(gen, model, folder):
        getattr(gen, method)(*args, **kw)
    return action


def _cache(kind: str, **kw):
    def action(gen, model, folder):
        import kvexplore
        kvexplore.make_cache(kind, model, **kw)
    return action


def _load(source=None, **kw):
    def action(gen, model, folder):
        import kvexplore
        kvexplore.load(folder if source is None else source, **kw)
    return action


def _fill(gen, model, folder):
    gen.step()  # the cache (24 slots) is full: the step that does not fit is refused


def _nan_temperature_step(gen, model, folder):
    gen.temperature = 1e-45  # legal, but logits / 1e-45 overflow: the step fails after the forward pass
    try:
        gen.step()
    finally:
        gen.temperature = 0.8


def _hook_fails(gen, model, folder):
    import kvexplore

    class Failing(kvexplore.Tracer):
        def hook(self, name, t):
            if name == f"layers.{model.config.num_layers - 1}.attn.q":
                raise kvexplore.StepError("hook failed mid-forward (on purpose)")
            return super().hook(name, t)

    gen.tracer = Failing(capture=("cache",))
    try:
        gen.step()
    finally:
        gen.tracer = None


def _explorer(**kw):
    def action(gen, model, folder):
        from kvexplore.explorer.session import Session
        Session(model, **kw)
    return action


def _tracer(**kw):
    def action(gen, model, folder):
        import kvexplore
        kvexplore.Tracer(**kw)
    return action


def _chat(gen, model, folder):
    model.tokenizer.chat_template = None
    gen.prefill_chat([{"role": "user", "content": "hi"}])


def _model_ids(ids):
    def action(gen, model, folder):
        model(ids(), gen.cache, gen.cache.length)
    return action


def _t(*shape_or_values, dtype=None):
    def make():
        import torch
        return torch.tensor(*shape_or_values, dtype=dtype) if dtype else torch.tensor(*shape_or_values)
    return make


def _trace(damage: str):
    def action(gen, model, folder):
        import tempfile

        import kvexplore
        path = Path(tempfile.mkdtemp()) / "run.kvtrace"
        gen.history.save(path)
        data = path.read_bytes()
        if damage == "truncated":
            path.write_bytes(data[: len(data) // 2])
        elif damage == "records":
            assert b"token_id" in data
            path.write_bytes(data.replace(b"token_id", b"token_jd", 1))
        elif damage == "missing":
            path.unlink()
        kvexplore.load_trace(path)
    return action


MISUSES = {
    "trace truncated": ("preallocated", _trace("truncated")),
    "trace records damaged": ("preallocated", _trace("records")),
    "trace missing": ("preallocated", _trace("missing")),
    "temperature nan": ("preallocated", _gen(temperature=float("nan"))),
    "temperature -1": ("preallocated", _gen(temperature=-1)),
    "temperature inf": ("preallocated", _gen(temperature=float("inf"))),
    "temperature str": ("preallocated", _gen(temperature="0.5")),
    "temperature bool": ("preallocated", _gen(temperature=True)),
    "top_k 2.5": ("preallocated", _gen(top_k=2.5)),
    "top_k 0": ("preallocated", _gen(top_k=0)),
    "top_k str": ("preallocated", _gen(top_k="3")),
    "top_p 0": ("preallocated", _gen(top_p=0)),
    "top_p 1.5": ("preallocated", _gen(top_p=1.5)),
    "top_p nan": ("preallocated", _gen(top_p=float("nan"))),
    "top_candidates -1": ("preallocated", _gen(top_candidates=-1)),
    "top_candidates 2.5": ("preallocated", _gen(top_candidates=2.5)),
    "top_candidates huge": ("preallocated", _gen(top_candidates=10 ** 9)),
    "seed -1": ("preallocated", _gen(seed=-1)),
    "seed str": ("preallocated", _gen(seed="x")),
    "live temperature nan": ("preallocated", _set("temperature", float("nan"))),
    "live top_k 2.5": ("paged", _set("top_k", 2.5)),
    "live top_p 2": ("quantized", _set("top_p", 2.0)),
    "live top_candidates -1": ("sink", _set("top_candidates", -1)),
    "live sampling str": ("concat", _set("sampling", "greedy")),
    "step before prefill": ("preallocated", _call("step")),
    "prefill empty list": ("preallocated", _call("prefill", [])),
    "prefill negative id": ("paged", _call("prefill", [-1, 3])),
    "prefill id past vocab": ("quantized", _call("prefill", [1, 10 ** 6])),
    "prefill float id": ("sink", _call("prefill", [1.5, 2])),
    "prefill str ids": ("concat", _call("prefill", ["a", "b"])),
    "prefill None": ("none", _call("prefill", None)),
    "prefill int": ("preallocated", _call("prefill", 5)),
    "prefill 2-D tensor": ("preallocated", _call("prefill", _t([[1, 2], [3, 4]])())),
    "prefill float tensor": ("preallocated", _call("prefill", _t([0.5, 1.5])())),
    "force -1": ("preallocated", _call("step", force=-1)),
    "force past vocab": ("paged", _call("step", force=10 ** 9)),
    "force str": ("quantized", _call("step", force="a")),
    "force float": ("sink", _call("step", force=1.5)),
    "run -1": ("concat", _call("run", -1)),
    "run 2.5": ("none", _call("run", 2.5)),
    "run str": ("preallocated", _call("run", "3")),
    "rewind -1": ("preallocated", _call("rewind", -1)),
    "rewind past history": ("paged", _call("rewind", 99)),
    "rewind 1.5": ("quantized", _call("rewind", 1.5)),
    "cache full preallocated": ("preallocated", _fill),
    "cache full paged": ("paged", _fill),
    "cache full quantized": ("quantized", _fill),
    "overflowing temperature preallocated": ("preallocated", _nan_temperature_step),
    "overflowing temperature concat": ("concat", _nan_temperature_step),
    "overflowing temperature none": ("none", _nan_temperature_step),
    "overflowing temperature paged": ("paged", _nan_temperature_step),
    "overflowing temperature quantized": ("quantized", _nan_temperature_step),
    "overflowing temperature sink": ("sink", _nan_temperature_step),
    "hook fails preallocated": ("preallocated", _hook_fails),
    "hook fails concat": ("concat", _hook_fails),
    "hook fails none": ("none", _hook_fails),
    "hook fails paged": ("paged", _hook_fails),
    "hook fails quantized": ("quantized", _hook_fails),
    "hook fails sink": ("sink", _hook_fails),
    "cache kind bogus": ("preallocated", _cache("bogus")),
    "cache kind list": ("preallocated", _cache(["preallocated"])),
    "max_seq_len 0": ("preallocated", _cache("preallocated", max_seq_len=0)),
    "max_seq_len -1 sink": ("preallocated", _cache("sink", max_seq_len=-1)),
    "max_seq_len 2.5": ("preallocated", _cache("paged", max_seq_len=2.5)),
    "max_seq_len str": ("preallocated", _cache("quantized", max_seq_len="8")),
    "max_seq_len huge": ("preallocated", _cache("preallocated", max_seq_len=10 ** 12)),
    "sink window 0": ("preallocated", _cache("sink", window=0)),
    "sink sinks -2": ("preallocated", _cache("sink", sinks=-2, window=4)),
    "paged block_size 0": ("preallocated", _cache("paged", max_seq_len=16, block_size=0)),
    "quantized bits 5": ("preallocated", _cache("quantized", max_seq_len=16, bits=5)),
    "quantized group_size 0": ("preallocated", _cache("quantized", max_seq_len=16, group_size=0)),
    "cache unknown option": ("preallocated", _cache("preallocated", max_seq_len=16, windw=3)),
    "cache batch_size 0": ("preallocated", _cache("preallocated", max_seq_len=16, batch_size=0)),
    "cache dtype int": ("preallocated", _cache("preallocated", max_seq_len=16, dtype="int8")),
    "cache device tpu": ("preallocated", _cache("preallocated", max_seq_len=16, device="tpu")),
    "load missing": ("preallocated", _load("/nonexistent/model")),
    "load number": ("preallocated", _load(123)),
    "load dtype int8": ("preallocated", _load(dtype="int8")),
    "load dtype torch.int8": ("preallocated", _load(dtype=__import__("torch").int8)),
    "load device tpu": ("preallocated", _load(device="tpu")),
    "load device cuda:7": ("preallocated", _load(device="cuda:7")),
    "session no strategies": ("preallocated", _explorer(strategies=())),
    "session bogus strategy": ("preallocated", _explorer(strategies=("bogus",))),
    "session repeated strategy": ("preallocated", _explorer(strategies=("paged", "paged"))),
    "tracer bogus capture": ("preallocated", _tracer(capture=("bogus",))),
    "chat without template": ("preallocated", _chat),
    "model ids 1-D": ("preallocated", _model_ids(_t([1, 2, 3]))),
    "model ids float": ("preallocated", _model_ids(_t([[1.0, 2.0]]))),
    "model ids past vocab": ("preallocated", _model_ids(_t([[10 ** 6]]))),
}
