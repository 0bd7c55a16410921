"""The explorer's lanes over several processes (``tp:N`` by heads, ``cp:N`` by positions; kvexplore.distributed.lead):
the kernel leads as rank 0 and spawned ranks follow each pass, on gloo over the loopback address. A lane over ranks
gives the tokens of one process (KL against the reference lane about 0), keeps every rank's part of each step in its
records (saved, replayed, drawn by the Ranks view), follows rewinds, and stops its ranks when closed or when the
kernel dies. A rank that dies or hangs stops its lane within the lane's bound (``timeout_s``) with an error naming
the rank, while the other lanes go on; Reset starts its ranks again."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

import kvexplore
from kvexplore.errors import SettingsError
from kvexplore.explorer.session import Session
from kvexplore.explorer.status import status_line, stopped_note
from kvexplore.trace.files import load_trace
from kvexplore.views.frames import frames

PROMPT = "The whale swam under the ship while the crew slept"


def _pids(lane) -> list[int]:
    return [p.pid for p in lane.generator.executor.leader.processes]


def _gone(pids: list[int], within_s: float) -> bool:
    """Every process of ``pids`` has exited (a zombie counts as exited) within ``within_s``."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        alive = []
        for pid in pids:
            try:
                with open(f"/proc/{pid}/stat") as f:
                    if f.read().rsplit(")", 1)[-1].split()[0] != "Z":
                        alive.append(pid)
            except OSError:
                pass
        if not alive:
            return True
        time.sleep(0.1)
    return False


def test_a_split_lane_is_refused_before_any_process_starts_when_it_cannot_run():
    model = kvexplore.load("tiny")
    with pytest.raises(SettingsError, match="at least 2 ranks"):
        Session(model, ("preallocated", "tp:1"))
    with pytest.raises(SettingsError, match="tp 3"):  # tiny has 2 KV heads and 8 query heads: 3 does not divide
        Session(model, ("preallocated", "tp:3"))
    with pytest.raises(SettingsError, match="unknown strategy 'tp:x'.*tp:2, cp:2"):
        Session(model, ("preallocated", "tp:x"))
    with pytest.raises(SettingsError, match="does not draft"):
        Session(model, ("preallocated", "tp:2"), strategy_options={"tp:2": {"draft": "prompt-lookup"}})
    built = kvexplore.Model(model.config)  # built in memory: the other ranks could not load it
    built.tokenizer = model.tokenizer
    with pytest.raises(SettingsError, match="loaded by name or folder"):
        Session(built, ("preallocated", "tp:2"))


@pytest.mark.slow
def test_lanes_over_ranks_give_one_process_tokens_and_keep_every_rank_in_their_records(tmp_path):
    ex = kvexplore.Explorer("tiny", strategies=("preallocated", "tp:2", "cp:2"), max_seq_len=64,
                            strategy_options={"cp:2": {"interleave": 4}})
    try:
        before = {name: _pids(ex.lanes[name]) for name in ("tp:2", "cp:2")}
        ex.prefill(PROMPT)
        assert {name: _pids(ex.lanes[name]) for name in before} == before  # the prefill kept the lanes' ranks
        ex.run(6)
        ref, tp, cp = (ex.lanes[n] for n in ("preallocated", "tp:2", "cp:2"))
        c = ex.model.config
        for lane in (tp, cp):
            assert lane.generator.tokens == ref.generator.tokens
            assert all(k is not None and k < 1e-5 for k in lane.kl[1:]), lane.kl
            assert all(lane.top1[1:])
        whole = ref.history[-1].memory.held_bytes

        step = tp.history[-1].trace.ranks
        assert [s.kv_heads for s in step.shares] == [(0,), (1,)]
        assert [s.held_bytes for s in step.shares] == [whole // 2] * 2 and step.whole_bytes == whole
        assert tp.history[-1].memory.held_bytes == step.shares[0].held_bytes  # the lane's cache is rank 0's
        for s in step.shares:  # a decode pass: one all-reduce after the attention and one after the MLP, per layer
            assert (s.calls, s.bytes) == (2 * c.num_layers, 2 * c.num_layers * c.hidden_size * 4)
        assert step.position == len(ref.generator.tokens) - 2 and step.tokens == 1

        step = cp.history[-1].trace.ranks
        n = len(ref.generator.tokens) - 1  # positions held after the last pass
        assert step.positions(1) == [p for p in range(n) if (p // 4) % 2 == 1]
        held = [p for p in cp.cache.inspect.slot_view(0).positions if p >= 0]
        assert held == step.positions(0)  # what the lane draws is rank 0's share
        assert sum(s.held_bytes for s in step.shares) == step.whole_bytes
        for layer in range(c.num_layers):  # rank 0's keys get what the merged softmax gives them in one process
            mine, one = cp.history[-1].trace.attention(layer)[-1], ref.history[-1].trace.attention(layer)[-1]
            keys = list(cp.history[-1].trace.reads_of(layer))
            assert keys == step.positions(0)
            assert (mine[:, keys] - one[:, keys]).abs().max() < 1e-5
            assert mine.sum(-1).max() < 1  # the rest went to rank 1's keys

        ex.rewind(2)
        ex.step()  # the other ranks cut their caches back to rank 0's first
        assert tp.generator.tokens == ref.generator.tokens == cp.generator.tokens

        ex.controls["lane"].value = "tp:2"
        spec = ex.specs(["ranks"])["ranks"]
        heat = spec.trace("held")
        assert sorted(zip(heat["y"].tolist(), heat["x"].tolist(), heat["z"].tolist())) == \
            [(0, 0, 1.0), (0, 1, 0.0), (1, 0, 0.0), (1, 1, 1.0)]
        last = tp.history[-1].trace.ranks
        bars = [t for t in spec.traces if t["name"] == "held" and t["type"] == "bar"][0]
        assert bars["x"] == [s.held_bytes for s in last.shares]  # one bar a rank, across
        inside = spec.trace("rank 0 in collectives")
        assert inside["y"][-1] == pytest.approx(last.shares[0].seconds * 1e3)

        tp.history.save(tmp_path / "tp.kvx")
        assert load_trace(tmp_path / "tp.kvx")[-1].trace.ranks == last
        drawn = frames(ex.session.runs())[0][-1]["figures"]
        assert {"ranks:tp:2", "ranks:cp:2"} <= set(drawn) and "ranks:preallocated" not in drawn

        with pytest.raises(SettingsError, match="fork another lane"):
            ex.session.fork("tp:2")
        pids = before["tp:2"] + before["cp:2"]
    finally:
        ex.close()
    assert _gone(pids, 10), "the explorer closed, its ranks still run"


@pytest.mark.slow
def test_a_rank_that_dies_or_hangs_stops_its_lane_within_its_bound_and_the_others_go_on():
    session = Session(kvexplore.load("tiny"), ("preallocated", "tp:2"), max_seq_len=64,
                      strategy_options={"tp:2": {"timeout_s": 3}})
    try:
        session.prefill(PROMPT)
        session.step()
        ref, tp = session.lanes["preallocated"], session.lanes["tp:2"]
        kept, length = len(tp.history), tp.cache.length
        dead = _pids(tp)
        os.kill(dead[0], signal.SIGKILL)
        t0 = time.monotonic()
        out = session.step()
        assert time.monotonic() - t0 < 3
        assert list(out) == ["preallocated"] and len(ref.history) == kept + 1
        assert "rank 1 of 2 stopped (killed by signal 9)" in str(tp.stopped)
        assert (len(tp.history), tp.cache.length) == (kept, length)  # the failed step left the lane as it was
        assert "a rank stopped" in status_line(tp) and "Reset or Prefill starts the lane's ranks again" in \
            stopped_note(list(session.lanes.values()))
        session.step()  # it sits out; the others go on
        assert len(ref.history) == kept + 2

        session.reset()  # starts its ranks again
        assert tp is not session.lanes["tp:2"] and session.lanes["tp:2"].stopped is None
        session.prefill(PROMPT)
        session.step()
        ref, tp = session.lanes["preallocated"], session.lanes["tp:2"]
        assert tp.generator.tokens == ref.generator.tokens

        hung = _pids(tp)
        os.kill(hung[0], signal.SIGSTOP)  # a rank that hangs: rank 0's all-reduce waits for it, up to timeout_s
        t0 = time.monotonic()
        out = session.step()
        waited = time.monotonic() - t0
        assert list(out) == ["preallocated"]
        assert waited < 3 + 6, waited  # gloo's timeout, then 2 s for the ranks' answers (measured: 5.1 s)
        assert "rank 1 of 2 did not answer" in str(tp.stopped) and "stopped by a signal" in str(tp.stopped)
        assert _gone(dead + hung, 10)  # the stopped rank was killed, not left behind
    finally:
        session.close()


@pytest.mark.slow
def test_the_ranks_of_a_lane_end_when_its_kernel_is_killed(tmp_path):
    script = textwrap.dedent("""
        import os, signal, sys, kvexplore
        from kvexplore.explorer.session import Session
        if __name__ == "__main__":
            s = Session(kvexplore.load("tiny"), ("preallocated", "tp:2", "cp:2"), max_seq_len=32)
            s.prefill("the whale")
            pids = [p.pid for n in ("tp:2", "cp:2") for p in s.lanes[n].generator.executor.leader.processes]
            print(" ".join(map(str, pids)), flush=True)
            os.kill(os.getpid(), signal.SIGKILL)  # as a kernel restart does: no finalizer runs
    """)
    path = tmp_path / "kernel.py"
    path.write_text(script)
    run = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, timeout=300)
    assert run.returncode == -signal.SIGKILL, run.stderr
    pids = [int(p) for p in run.stdout.split()]
    assert len(pids) == 2
    assert _gone(pids, 15), "the kernel died, its ranks still run"


@pytest.mark.long  # starts rank processes that import the package
def test_rank_0_may_spend_longer_than_timeout_s_between_two_collectives():
    """Rank 0 also records what the explorer draws: at a chapter's length its pass spends longer than ``timeout_s``
    between two collectives, and the other ranks wait for it (only a rank rank 0 waits for is held to ``timeout_s``)."""
    session = Session(kvexplore.load("tiny"), ("preallocated", "tp:2"), max_seq_len=64,
                      strategy_options={"tp:2": {"timeout_s": 1}})
    try:
        session.prefill(PROMPT)
        tp = session.lanes["tp:2"]
        slow = tp.generator.executor.leader.model0.model.layers[1].register_forward_pre_hook(lambda *_: time.sleep(2))
        session.step()  # rank 1 waits 2 s for rank 0 in the first layer's all-reduce
        slow.remove()
        session.step()
        assert tp.stopped is None and tp.generator.tokens == session.lanes["preallocated"].generator.tokens
    finally:
        session.close()


@pytest.mark.long  # starts rank processes that import the package
def test_an_interrupt_sent_to_the_kernels_process_group_leaves_the_ranks_running():
    """Jupyter's interrupt (and a server shutting its kernels down) signals SIGINT to the kernel's process group, which
    the ranks share: they carry on (they end with their driver's pipe)."""
    session = Session(kvexplore.load("tiny"), ("preallocated", "tp:2"), max_seq_len=64)
    try:
        session.prefill(PROMPT)
        tp = session.lanes["tp:2"]
        for pid in _pids(tp):
            os.kill(pid, signal.SIGINT)
        time.sleep(0.5)
        session.step()
        assert tp.stopped is None and tp.generator.tokens == session.lanes["preallocated"].generator.tokens
    finally:
        session.close()
