"""The harness of the course's code exercises (kvexplore/course/code_check.py): each exercise declares how its cache is
built from a student's class; a page table that writes into a shared page passes the doctor and is caught by the fork;
bookkeeping that leaves every output right is caught by the audit; the scaffolds as shipped say they are not written."""

from __future__ import annotations

import pytest

import kvexplore
from kvexplore import course
from kvexplore.course import solutions
from kvexplore.course.code_check import (CodeExercise, PageTableExercise, RingLayerExercise, exercise_of, fork_check,
                                         ring_cache)
from kvexplore.course.solutions import n05, n08

LAYERS = [e.id for e in course.exercises() if e.answer_is == "layer"]


def test_every_code_exercise_declares_its_harness_and_its_reference_subclasses_the_base():
    assert {"02.2", "05.2", "08.1"} <= set(LAYERS)
    for exercise in LAYERS:
        spec = exercise_of(exercise)
        assert isinstance(spec, CodeExercise)
        assert issubclass(solutions.reference(exercise), spec.base)
        assert all(issubclass(cls, spec.base) for cls, _ in solutions.wrong(exercise))


def test_writing_into_a_shared_page_passes_the_doctor_and_is_caught_by_the_fork():
    from kvexplore.diagnosis.run import doctor

    spec = exercise_of("05.2")
    model = spec.model()
    alone = doctor(model, prompt=spec.prompt, steps=spec.steps, cache=spec.cache(model, n05.WritesIntoSharedPage))
    assert not alone.diverged  # one sequence never shares a page: only a fork shows the mistake
    assert fork_check(model, lambda: spec.cache(model, n05.Reference), spec.fork) == ""
    parted = fork_check(model, lambda: spec.cache(model, n05.WritesIntoSharedPage), spec.fork)
    assert "after a fork of a 6-token prefix" in parted and "changed what the other reads" in parted
    verdict = course.check("05.2", n05.WritesIntoSharedPage)
    assert not verdict.ok and "after a fork" in verdict.message and "copy-on-write" in verdict.message


def test_a_fork_keeps_the_students_page_table_on_the_shared_pool():
    import torch

    spec = exercise_of("05.2")
    model = spec.model()
    cache = spec.cache(model, n05.Reference)
    with torch.no_grad():
        model(torch.tensor([spec.fork.prompt]), cache, 0)
    twin = cache.fork()
    assert type(cache.table) is type(twin.table) is n05.Reference
    assert twin.pool is cache.pool and twin.block_tables == cache.block_tables


def test_bookkeeping_that_leaves_every_output_right_is_still_wrong():
    class KeepsTheOldReference(n05.Reference):  # copies the shared page but never drops its reference: a leak
        def make_room(self, table, pos, q_len):
            bs = self.block_size
            if pos % bs and self.pool.refcount[table[-1]] > 1:
                new = self.take()
                self.copy_page(table[-1], new, pos % bs)
                table[-1] = new
            while len(table) < -(-(pos + q_len) // bs):
                table.append(self.take())

    verdict = course.check("05.2", KeepsTheOldReference)
    assert not verdict.ok and "every output is right, yet the bookkeeping is not" in verdict.message
    assert "still counts 2 holders" in verdict.message


def test_the_ring_serves_only_the_sliding_layers():
    from kvexplore.caches.strategies.preallocated import PreallocatedCache

    model = exercise_of("08.1").model()
    cache = ring_cache(PreallocatedCache, n08.Reference)(model.config, max_seq_len=32)
    kinds = [spec.kind for spec in cache.plan]
    assert kinds == ["sliding"] * 3 + ["full"]
    assert [isinstance(layer, n08.Reference) for layer in cache.layers] == [True] * 3 + [False]
    assert cache.layers[0].window == n08.WINDOW < len(n08.PROMPT)


@pytest.mark.parametrize("exercise, base", [("05.2", PageTableExercise), ("08.1", RingLayerExercise)])
def test_the_scaffold_as_shipped_says_it_is_not_written_and_another_class_is_refused(exercise, base):
    class Scaffold(base):
        pass

    verdict = course.check(exercise, Scaffold)
    assert not verdict.ok and "is not written yet" in verdict.message and "NotImplementedError" not in verdict.message
    with pytest.raises(kvexplore.SettingsError, match=f"a subclass of {base.__name__}"):
        course.check(exercise, n05.Reference if base is RingLayerExercise else n08.Reference)
    with pytest.raises(kvexplore.SettingsError, match=f"a subclass of {base.__name__}"):
        course.check(exercise, 42)
