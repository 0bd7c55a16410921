"""Speculation: a verification keeps exactly the drafts the target would have chosen, and its take-back leaves the cache
a cache that never saw the rejected drafts would be. Greedy speculative decoding is plain greedy decoding, token for
token; these bugs break that."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..caches.strategies.concat import ConcatCache
from ..caches.factory import make_cache
from ..caches.layers.concat_layer import ConcatLayer
from ..diagnosis.speculation import check_speculation
from ..runtime.generator import Generator
from ..speculation.speculative import Speculation
from ..trace.tracer import Tracer
from .catalog import Bug, register
from .runs import Run, text_ids


def speculative_scenario(text: str, steps: int, make: Callable[[Any, bool], Generator]) -> tuple[Any, Any]:
    """The ``run`` and ``check`` of a bug shown by speculative decoding: ``make(model, planted)`` gives a greedy
    generator with a drafter (and the planted cache or speculation); the run keeps each record's token (one unit per
    step), the check is :func:`~kvexplore.diagnosis.speculation.check_speculation` on the same."""

    def run(model: Any, planted: bool) -> Run:
        gen = make(model, planted)
        ids = text_ids(model, text)
        gen.prefill(ids)
        while len(gen.history) < steps:
            gen.step()
        records = gen.history[:steps]
        out = Run(planted, "step", [[r.token_id] for r in records], [None] * len(records),
                  [len(ids) - 1 + s for s in range(len(records))], ids, gen)
        out.notes = [f"verification {v.index}: drafted {len(v.drafted)}, accepted {v.accepted}, gave back "
                     f"{v.rolled_back} ({v.take_back})" for v in gen.speculation.verifications]
        out.replay = lambda: records
        return out

    def check(model: Any, planted: bool) -> Any:
        return check_speculation(make(model, planted), text_ids(model, text), steps)

    return run, check


TEXT = ("one two three four five six seven eight nine ten, one two three four five six seven eight nine ten, "
        "one two three four five six seven eight")
STEPS = 24


class AppendOnlyLayer(ConcatLayer):
    """The planted bug: the layer's trim is a no-op and a write appends whatever the length says (as a cache that
    cannot be trimmed does), so the rejected drafts' keys and values stay ahead of the next token."""

    def write(self, step, k, v):
        if self.k is None or step.pos == 0:
            return super().write(step, k, v)
        self.k, self.v = torch.cat([self.k, k], dim=2), torch.cat([self.v, v], dim=2)  # after all it holds
        step.counters.written_bytes += k.nbytes + v.nbytes
        return self.k, self.v

    def mask(self, step):
        if self.k is None:
            return super().mask(step)
        n, q = self.k.shape[2], step.q_len
        return torch.ones(q, n, dtype=torch.bool, device=step.device).tril(n - q)

    def truncate(self, n: int, length: int, counters) -> None:
        return None


class UntrimmedCache(ConcatCache):
    def full_layer(self, spec):
        return AppendOnlyLayer(spec, self.batch_size, self.dtype, self.device)


def _untrimmed(model: Any, planted: bool, slots: int = 128) -> Generator:
    cache = UntrimmedCache(model.config, dtype=model.dtype) if planted else make_cache("concat", model)
    return Generator(model, cache, draft="prompt-lookup", draft_tokens=4, tracer=Tracer())


_untrimmed_run, _untrimmed_check = speculative_scenario(TEXT, STEPS, _untrimmed)
register(Bug(
    name="rejected-drafts-stay", engine="mlx-lm (speculative decoding)", reference="ml-explore/mlx-lm#1109",
    url="https://github.com/ml-explore/mlx-lm/pull/1109", area="speculation",
    summary="Speculative decoding rolled rejected drafts back with a trim that is a no-op for caches that cannot "
            "be trimmed, so the rejected drafts stayed in the cache and every later token attended to them "
            "(this project's own transformers bridge had the same shape: a static layer's cumulative_length not "
            "restored on rollback, commit c3a2699). Planted as a growing cache whose trim does nothing.",
    invariant="after a verification the cache holds exactly the kept tokens: length, slots and every counter a "
              "layer keeps",
    symptom="output parts from plain decoding after the first rejected draft",
    checker="speculation", run=_untrimmed_run, check=_untrimmed_check, make=_untrimmed))


class WrongRowSpeculation(Speculation):
    """The planted bug: after a rejected draft the correction is drawn from the next row of logits (the row that saw
    the rejected draft as context), as a rejection handled one iteration late does."""

    @staticmethod
    def accept(logits, draft, settings, rng):
        new, accepted = Speculation.accept(logits, draft, settings, rng)
        if accepted < len(draft.tokens) and accepted + 1 < logits.shape[0]:
            new[-1] = int(logits[accepted + 1].argmax())
        return new, accepted


def _wrong_row(model: Any, planted: bool, slots: int = 128) -> Generator:
    cache = make_cache("preallocated", model, max_seq_len=slots)
    gen = Generator(model, cache, draft="prompt-lookup", draft_tokens=4, tracer=Tracer())
    if planted:
        gen.speculation = WrongRowSpeculation("prompt-lookup", 4, gen.executor, cache)
    return gen


_row_run, _row_check = speculative_scenario(TEXT, STEPS, _wrong_row)
register(Bug(
    name="correction-from-wrong-row", engine="OpenVINO GenAI (speculative decoding)",
    reference="openvinotoolkit/openvino.genai#4190", url="https://github.com/openvinotoolkit/openvino.genai/issues/4190",
    area="speculation",
    summary="A rejection handled one iteration late drew the replacement token from the logit row after the "
            "rejected one, conditioned on the rejected draft: the rejected word was deleted and its predicted "
            "continuation kept. Planted as an acceptance that takes the correction from the next row.",
    invariant="at the first rejected draft the token kept is the target's choice from the row of the last accepted "
              "position; greedy speculative output equals plain greedy output token for token",
    symptom="words go missing where a draft was rejected; the cache itself is consistent with the (wrong) tokens",
    checker="speculation", run=_row_run, check=_row_check, make=_wrong_row))
