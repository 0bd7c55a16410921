"""One rule for every registry of named extensions (strategies, layer kinds, presses, drafters, prefix policies):
a taken name is refused unless asked to replace it, a built-in entry is neither replaced nor removed, an unknown
name cannot be removed, and what was registered from outside runs (a toy drafter through the generator, a toy prefix
policy through the pool)."""

from __future__ import annotations

from dataclasses import replace

import pytest

import kvexplore
from kvexplore.caches.presses import PRESSES, Press, register_press, unregister_press
from kvexplore.caches.registry import (LAYER_KINDS, PREFIXES, STRATEGIES, register_layer_kind, register_prefix,
                                       register_strategy, unregister_layer_kind, unregister_prefix,
                                       unregister_strategy)
from kvexplore.config.families import ARCHITECTURES, lookup
from kvexplore.config.families import register as register_architecture, unregister as unregister_architecture
from kvexplore.errors import SettingsError
from kvexplore.prefix import POLICIES, register_policy, unregister_policy
from kvexplore.prefix.hashing import HashIndex
from kvexplore.speculation.drafters import DRAFTERS, Draft, Drafter, register_drafter, unregister_drafter
from kvexplore.models.executor import ADAPTERS, as_executor, register_adapter, unregister_adapter
from kvexplore.views import registry as views
from kvexplore.views.prefix import PREFIX_FIGURES, register_prefix_figure, unregister_prefix_figure
from kvexplore.views.spec import FigureSpec


class Toy(Press):
    name = "toy"

    def score(self, obs):
        return obs.keys.float().norm(dim=-1)


class Toy2(Toy):
    name = "toy"


class Lookalike(STRATEGIES["preallocated"]):
    kind = "lookalike"


class Lookalike2(Lookalike):
    pass


class Impostor(STRATEGIES["preallocated"]):
    kind = "preallocated"


class KNormImpostor(Toy):
    name = "knorm"


def _layer(cache, spec, built, shared):
    return LAYER_KINDS["full"](cache, spec, built, shared)


def _layer2(cache, spec, built, shared):
    return LAYER_KINDS["full"](cache, spec, built, shared)


# each registry: (its dict, register(name, entry, replace), unregister(name), a built-in name and an entry that
# would take it, a new name and two entries for it)
CASES = {
    "strategy": (STRATEGIES, lambda n, e, r=False: register_strategy(n, e, replace=r), unregister_strategy,
                 "preallocated", Impostor, "lookalike", Lookalike, Lookalike2),
    "layer kind": (LAYER_KINDS, lambda n, e, r=False: register_layer_kind(n, e, replace=r), unregister_layer_kind,
                   "full", _layer2, "toy_kind", _layer, _layer2),
    "press": (PRESSES, lambda n, e, r=False: register_press(e, replace=r), unregister_press, "knorm", KNormImpostor,
              "toy", Toy, Toy2),
    "drafter": (DRAFTERS, lambda n, e, r=False: register_drafter(n, e, replace=r), unregister_drafter,
                "prompt-lookup", lambda a, ex: None, "toy", lambda a, ex: None, lambda a, ex: None),
    "view": (views.VIEWS, lambda n, e, r=False: views.register(e, replace=r), views.unregister, "attention",
             views.View("attention", "Mine", lambda snap: None), "toy_view",
             views.View("toy_view", "One", lambda s: None), views.View("toy_view", "Two", lambda s: None)),
    "prefix figure": (PREFIX_FIGURES, lambda n, e, r=False: register_prefix_figure(n, e, replace=r),
                      unregister_prefix_figure, "prefix_pool", lambda f, i: None, "toy_figure", lambda f, i: None,
                      lambda f, i: None),
    "model adapter": (ADAPTERS, lambda n, e, r=False: ADAPTERS[register_adapter(*e, name=n, replace=r)],
                         unregister_adapter, "kvexplore", (callable, callable), "toy", (callable, int),
                         (callable, float)),
    "architecture": (ARCHITECTURES, lambda n, e, r=False: register_architecture(e, replace=r),
                     unregister_architecture, "LlamaForCausalLM",
                     replace(lookup("LlamaForCausalLM"), name="mine", model_type="mine"), "ToyArchForCausalLM",
                     replace(lookup("LlamaForCausalLM"), name="toyarch", hf_class="ToyArchForCausalLM",
                             model_type="toyarch"),
                     replace(lookup("LlamaForCausalLM"), name="toyarch", hf_class="ToyArchForCausalLM",
                             model_type="toyarch", family="toy")),
    "name prefix": (PREFIXES, lambda n, e, r=False: register_prefix(n, e, replace=r), unregister_prefix, "hf:",
                    lambda m, k, n: None, "toy:", lambda m, k, n: None, lambda m, k, n: None),
    "prefix policy": (POLICIES, lambda n, e, r=False: register_policy(n, e, replace=r), unregister_policy, "hash",
                      lambda size: HashIndex(size), "toy", HashIndex, lambda size: HashIndex(size)),
}


@pytest.mark.parametrize("what", list(CASES))
def test_every_registry_refuses_a_taken_name_unless_asked_and_keeps_its_built_ins(what):
    registry, register, unregister, built_in, impostor, name, first, second = CASES[what]
    before = dict(registry)
    try:
        assert register(name, first) == first and registry[name] == first  # (an adapter's pair is a new tuple)
        assert register(name, first) == first  # the same entry again: nothing changes
        a = "an" if what[0] in "aeiou" else "a"
        with pytest.raises(SettingsError, match=f"{a} {what} named '{name}' is already registered.*pass "
                                                f"replace=True, or call unregister"):
            register(name, second)
        assert registry[name] == first
        assert register(name, second, True) == second and registry[name] == second
        for attempt in (lambda: register(built_in, impostor), lambda: register(built_in, impostor, True)):
            with pytest.raises(SettingsError, match=f"{what} '{built_in}' is built in and cannot be replaced"):
                attempt()
        with pytest.raises(SettingsError, match=f"{what} '{built_in}' is built in; only {a} {what} registered later"):
            unregister(built_in)
        assert unregister(name) == second and name not in registry
        with pytest.raises(SettingsError, match=f"no {what} named '{name}' is registered; registered: "):
            unregister(name)
    finally:
        registry.pop(name, None)
    assert registry == before


def test_a_drafter_registered_from_outside_drafts_through_the_generator(tiny):
    """A toy drafter ("again:n": the newest token n times) runs through greedy speculative decoding: the target's
    greedy tokens are unchanged, and its drafts were checked (some accepted, the rest rejected)."""

    class Again(Drafter):
        def __init__(self, times):
            self.times, self.name = times, f"again:{times}"

        def propose(self, tokens, k, sampling, rng):
            return Draft([tokens[-1]] * min(k, self.times))

    def make(argument, executor):
        if argument is None or not argument.isdigit():
            raise SettingsError(f"draft='again:n' takes a whole number, got {argument!r}")
        return Again(int(argument))

    register_drafter("again", make)
    try:
        prompt = [5, 9, 9, 9, 9, 3, 7]
        plain = kvexplore.Generator(tiny, kvexplore.make_cache("preallocated", tiny, max_seq_len=64))
        plain.prefill(prompt)
        plain.run(16, stop_at_eos=False)
        drafted = kvexplore.Generator(tiny, kvexplore.make_cache("preallocated", tiny, max_seq_len=64),
                                      draft="again:2", draft_tokens=2)
        drafted.prefill(prompt)
        drafted.run(16, stop_at_eos=False)
        n = len(plain.tokens)
        assert drafted.tokens[:n] == plain.tokens
        checked = drafted.speculation.verifications
        assert drafted.speculation.drafter.name == "again:2" and checked
        assert all(v.drafted == [v.drafted[0]] * len(v.drafted) for v in checked)
        with pytest.raises(SettingsError, match="takes a whole number"):
            kvexplore.Generator(tiny, kvexplore.make_cache("preallocated", tiny, max_seq_len=64), draft="again:x")
        with pytest.raises(SettingsError, match="is not a drafter: give 'prompt-lookup', 'self:L' .*, 'again'"):
            kvexplore.Generator(tiny, kvexplore.make_cache("preallocated", tiny, max_seq_len=64), draft="twice")
    finally:
        unregister_drafter("again")


def test_a_prefix_policy_registered_from_outside_serves_through_the_pool(tiny):
    """A toy policy (vLLM's hash chain that also counts its look-ups) serves requests: the hits equal the built-in
    hash policy's, and its look-ups were made; a policy that makes something else is refused by name."""

    class CountingHash(HashIndex):
        def __init__(self, block_size):
            super().__init__(block_size)
            self.lookups = 0

        def match(self, ids, hashes):
            self.lookups += 1
            return super().match(ids, hashes)

    register_policy("counting", CountingHash)
    try:
        system = list(range(1, 11))
        hits = {}
        for policy in ("hash", "counting"):
            pool = kvexplore.PrefixPool(tiny, num_blocks=16, block_size=4, policy=policy)
            pool.serve(system + [100, 101, 102], response=[5])
            hits[policy] = pool.serve(system + [200, 201, 202], response=[5]).hit_tokens
        assert hits["counting"] == hits["hash"] == 8 and pool.index.lookups == 2
        register_policy("broken", lambda size: object())
        with pytest.raises(SettingsError, match="prefix policy 'broken' made a object, not a PrefixIndex"):
            kvexplore.PrefixPool(tiny, num_blocks=16, block_size=4, policy="broken")
        with pytest.raises(SettingsError, match=r"policy must be one of \['broken', 'counting', 'hash', 'radix'\]"):
            kvexplore.PrefixPool(tiny, num_blocks=16, block_size=4, policy="lru")
    finally:
        POLICIES.pop("broken", None)
        unregister_policy("counting")


def test_a_prefix_figure_registered_from_outside_is_drawn_by_the_widget_and_the_page(tmp_path):
    """A toy prefix figure (the number of blocks in each state) is drawn in its own row by PrefixView and carried
    by the replay page, with its div, for every frame; unregistered, neither draws it."""
    import prefix_hand
    from kvexplore.views.prefix_page import page_data, prefix_fragment

    frames = prefix_hand.frames()

    def states(frames, i):
        counts = {}
        for block in frames[i].blocks:
            counts[block.state] = counts.get(block.state, 0) + 1
        return FigureSpec([{"type": "bar", "x": list(counts), "y": list(counts.values())}],
                          {"title": {"text": "blocks"}})

    register_prefix_figure("block_states", states)
    try:
        view = kvexplore.PrefixView(frames, frame=1)
        assert list(view.figures)[-1] == "block_states"
        bars = view.state()["specs"]["block_states"]["traces"][0]
        assert sum(bars["y"]) == len(frames[1].blocks) and "block_states" in view.state()["shown"]
        view.show(len(frames) - 1)
        assert sum(view.state()["specs"]["block_states"]["traces"][0]["y"]) == len(frames[-1].blocks)
        assert all("block_states" in f["figures"] for f in page_data(frames)["frames"])
        assert '<div class="kvx-fig-block_states"></div>' in prefix_fragment(frames)
    finally:
        unregister_prefix_figure("block_states")
    assert "block_states" not in kvexplore.PrefixView(frames).figures
    assert "kvx-fig-block_states" not in prefix_fragment(frames)


def test_a_model_adapter_registered_from_outside_runs_through_the_generator(tiny):
    """A toy model class (a kvexplore model behind another object) becomes runnable once its adapter is registered;
    before, and after unregistering it, the generator refuses it and names what it takes."""

    class Boxed:
        def __init__(self, model):
            self.inside = model

    boxed = Boxed(tiny)
    with pytest.raises(SettingsError, match="model must be a kvexplore Model"):
        as_executor(boxed)
    name = register_adapter(lambda m: isinstance(m, Boxed), lambda m: as_executor(m.inside), name="boxed")
    try:
        assert name == "boxed" and set(ADAPTERS.built_in) == {"kvexplore", "transformers"}
        gen = kvexplore.Generator(boxed)
        gen.prefill("The cache")
        ref = kvexplore.Generator(tiny)
        ref.prefill("The cache")
        assert [r.token_id for r in gen.run(6)] == [r.token_id for r in ref.run(6)]
    finally:
        unregister_adapter("boxed")
    with pytest.raises(SettingsError, match="model must be a kvexplore Model"):
        kvexplore.Generator(boxed)
