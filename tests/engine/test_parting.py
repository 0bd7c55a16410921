"""kvexplore/trace/parting.py: the one rule of where two runs part, which the trace diff, the doctor, the bug zoo and
the explorer all apply."""

from __future__ import annotations

import math

import torch

from kvexplore.trace.parting import first_parting, kl_divergence, parts


def test_runs_part_at_another_token_or_a_gap_strictly_beyond_the_tolerance():
    assert parts(False, None, 0.1) and parts(False, 0.0, 0.1)  # another token: parted, whatever the gap
    assert parts(None, 0.2, 0.1) and parts(True, math.inf, 0.1)
    assert not parts(True, 0.1, 0.1)  # equal to the tolerance: not beyond it
    assert not parts(None, None, 0.0) and not parts(True, None, 0.0)  # nothing measured differs
    assert not parts(None, math.nan, 0.1)  # a NaN gap is no evidence either way


def test_the_first_parting_names_the_place_as_the_caller_does_and_reads_no_further():
    read = []

    def compared():
        for i, (same, gap) in enumerate([(True, 0.0), (None, None), (True, 0.5), (False, 0.0)]):
            read.append(i)
            yield f"step {i}", same, gap

    assert first_parting(compared(), 0.1) == "step 2"
    assert read == [0, 1, 2]
    assert first_parting(compared(), 1.0) == "step 3"
    assert first_parting([], 0.1) is None
    assert first_parting([(0, True, 0.1), (1, None, None)], 0.1) is None


def test_kl_divergence_is_zero_for_one_distribution_and_infinite_where_q_rules_out_a_token_p_allows():
    p = torch.tensor([0.5, 0.5, 0.0]).log()
    assert kl_divergence(p, p) == 0.0  # 0 log 0 counts 0 (the third token)
    q = torch.tensor([0.25, 0.75, 0.0]).log()
    assert math.isclose(kl_divergence(p, q), 0.5 * math.log(2) + 0.5 * math.log(0.5 / 0.75), rel_tol=1e-6)
    assert kl_divergence(p, torch.tensor([1.0, 0.0, 0.0]).log()) == math.inf
    assert math.isclose(kl_divergence(torch.tensor([1.0, 0.0, 0.0]).log(), p), math.log(2), rel_tol=1e-6)
