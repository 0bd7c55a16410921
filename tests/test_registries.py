"""One rule for every registry of named extensions (strategies, layer kinds, presses, drafters, prefix policies):
a taken name is refused unless asked to replace it, a built-in entry is neither replaced nor removed, an unknown
name cannot be removed, and what was registered from outside runs (a toy drafter through the generator, a toy prefix
policy through the pool)."""

from __future__ import annotations

import pytest

import kvexplore
from kvexplore.caches.presses import PRESSES, Press, register_press, unregister_press
from kvexplore.caches.registry import (LAYER_KINDS, STRATEGIES, register_layer_kind, register_strategy,
                                       unregister_layer_kind, unregister_strategy)
from kvexplore.errors import SettingsError
from kvexplore.prefix import POLICIES, register_policy, unregister_policy
from kvexplore.prefix.hashing import HashIndex
from kvexplore.runtime.drafters import DRAFTERS, Draft, Drafter, register_drafter, unregister_drafter


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
    "prefix policy": (POLICIES, lambda n, e, r=False: register_policy(n, e, replace=r), unregister_policy, "hash",
                      lambda size: HashIndex(size), "toy", HashIndex, lambda size: HashIndex(size)),
}


@pytest.mark.parametrize("what", list(CASES))
def test_every_registry_refuses_a_taken_name_unless_asked_and_keeps_its_built_ins(what):
    registry, register, unregister, built_in, impostor, name, first, second = CASES[what]
    before = dict(registry)
    try:
        assert register(name, first) is first and registry[name] is first
        assert register(name, first) is first  # the same entry again: nothing changes
        with pytest.raises(SettingsError, match=f"a {what} named '{name}' is already registered.*pass "
                                                f"replace=True, or call unregister_"):
            register(name, second)
        assert registry[name] is first
        assert register(name, second, True) is second and registry[name] is second
        for attempt in (lambda: register(built_in, impostor), lambda: register(built_in, impostor, True)):
            with pytest.raises(SettingsError, match=f"{what} '{built_in}' is built in and cannot be replaced"):
                attempt()
        with pytest.raises(SettingsError, match=f"{what} '{built_in}' is built in; only a {what} registered later"):
            unregister(built_in)
        assert unregister(name) is second and name not in registry
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
