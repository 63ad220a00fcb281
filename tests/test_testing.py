"""run_distributed's kept ranks: each call as a new process would see it, and a failure or a hang
in one call reported by rank and kept from the next; run_each's calls at once, each on its own
ranks."""

from __future__ import annotations

import os
import sys
import time

import pytest
import torch
import torch.fx
import torch.distributed as dist

from loong_compile.testing import DistributedFailure, keep_ranks, run_distributed, run_each

pytestmark = pytest.mark.multirank  # spawns gloo ranks


def _pid_and_state(rank, world, leave_behind: bool):
    """This rank's pid, and what an earlier call could have left: an environment variable, a
    mesh built with init_mesh, a compiled function, a default dtype."""
    import loong_compile as lc
    from loong_compile.parallel import mesh

    seen = {"env": os.environ.get("LEFT_BEHIND"), "meshes": len(mesh._USER_MESHES),
            "dtype": str(torch.get_default_dtype()), "world": dist.get_world_size()}
    if leave_behind:
        os.environ["LEFT_BEHIND"] = "1"
        lc.init_mesh(hp=1, cp=2)
        torch.set_default_dtype(torch.float64)
    t = torch.ones(1)
    dist.all_reduce(t)
    return os.getpid(), seen, t.item()


def _raise_on(rank, world, bad_rank: int, then_wait: bool):
    if rank == bad_rank:
        raise ValueError(f"case broken on purpose on rank {rank}")
    if then_wait:  # the others wait for it in a collective, as in a real step
        dist.all_reduce(torch.ones(1))
    return rank


def _hang_on(rank, world, bad_rank: int):
    if rank == bad_rank:
        time.sleep(3600)
    return rank


def test_kept_ranks_serve_many_calls_each_as_a_new_process():
    with keep_ranks():
        first = run_distributed(_pid_and_state, 2, True, timeout=120)
        second = run_distributed(_pid_and_state, 2, False, timeout=120)
    assert [pid for pid, _, _ in first] == [pid for pid, _, _ in second]   # the same processes
    for _, seen, total in second:
        assert seen == {"env": None, "meshes": 0, "dtype": "torch.float32", "world": 2}
        assert total == 2
    with keep_ranks(False):   # each call spawns its ranks and ends them
        once, again = (run_distributed(_pid_and_state, 2, False, timeout=120) for _ in range(2))
    assert {pid for pid, _, _ in once}.isdisjoint(pid for pid, _, _ in again)


def test_a_failing_rank_is_named_and_the_next_call_runs():
    with keep_ranks():
        # rank 1 raises while rank 0 waits for it in an all_reduce: rank 0 never reports
        start = time.monotonic()
        with pytest.raises(DistributedFailure) as failure:
            run_distributed(_raise_on, 2, 1, True, timeout=120)
        assert time.monotonic() - start < 45   # the grace after a failure, not the timeout
        # rank 1 first, then rank 0 whose all_reduce lost its peer (gloo) or nothing (killed)
        assert next(iter(failure.value.errors)) == 1
        assert "first rank 1: ValueError: case broken on purpose on rank 1" in str(failure.value)
        # the next call runs (on the same ranks if every rank reported, on new ones if not)
        after = run_distributed(_pid_and_state, 2, False, timeout=120)
        assert [total for _, _, total in after] == [2.0, 2.0]
        # one rank raised, the other returned: both reported, the ranks are kept
        with pytest.raises(DistributedFailure) as failure:
            run_distributed(_raise_on, 2, 0, False, timeout=120)
        assert set(failure.value.errors) == {0}
        kept = run_distributed(_pid_and_state, 2, False, timeout=120)
        assert [pid for pid, _, _ in kept] == [pid for pid, _, _ in after]


def test_a_hang_fails_within_its_timeout_and_the_next_call_runs():
    with keep_ranks():
        run_distributed(_hang_on, 2, 5, timeout=120)   # the ranks started: the timeout is the call's
        start = time.monotonic()
        with pytest.raises(TimeoutError, match=r"ranks \[1\] did not finish within 5 s"):
            run_distributed(_hang_on, 2, 1, timeout=5)
        assert time.monotonic() - start < 45
        # the hung rank and the other were ended: new ranks run the next call
        assert run_distributed(_hang_on, 2, 5, timeout=120) == [0, 1]


def _pid(rank, world):
    return os.getpid()


def test_a_guest_pool_is_ended_before_the_suites_own(monkeypatch, tmp_path):
    """With room for three ranks: two kept for the suite's own sys.path, then one for a test's
    stand-ins (in front of sys.path); a third pool needs room, and the guest's rank is the one
    ended.  An entry added behind sys.path (setuptools adds its vendored packages when first
    imported) keeps the suite's pools."""
    from loong_compile import testing

    monkeypatch.setattr(testing, "MAX_KEPT_RANKS", 3)
    with keep_ranks():
        home = run_distributed(_pid, 2, timeout=120)
        with monkeypatch.context() as guest:
            guest.syspath_prepend(str(tmp_path))
            run_distributed(_pid, 1, timeout=120)
        monkeypatch.setattr(sys, "path", [*sys.path, str(tmp_path / "behind")])
        run_distributed(_pid, 1, timeout=120)   # the suite's own one-rank pool
        assert run_distributed(_pid, 2, timeout=120) == home


def _pid_after_a_while(rank, world):
    time.sleep(2)   # long enough that the other lane's calls start meanwhile
    return os.getpid()


def test_calls_at_once_run_on_ranks_of_their_own_and_fail_alone():
    """Two lanes: the calls running at once never share a rank, a lane's later calls reuse its
    ranks, and a call that raised is that call's result while the others report."""
    calls = [(_pid_after_a_while, 2, ()), (_pid_after_a_while, 2, ()),
             (_raise_on, 2, (1, False)), (_pid_after_a_while, 2, ()), (_pid_after_a_while, 2, ())]
    with keep_ranks():
        results = run_each(calls, timeout=120)
    failed = results.pop(2)
    assert isinstance(failed, DistributedFailure) and "rank 1: ValueError" in str(failed), failed
    pids = [tuple(r) for r in results]
    assert set(pids[0]).isdisjoint(pids[1])   # the first two ran at once
    assert len(set(pids)) == 2   # each lane's ranks serve its later calls


def _one_trust_cell(rank, world):
    from trust_cases import Case
    from trust_run import run_case

    return run_case(rank, world, 1, 2, Case("llama"))[0]


def _graph_modules_alive(rank, world):
    import gc

    gc.collect()
    return sum(isinstance(o, torch.fx.GraphModule) for o in gc.get_objects())


def test_kept_ranks_keep_no_graph_of_an_earlier_call():
    """Dynamo keeps each compiled graph as a global of the compiled frame's module, past
    torch.compiler.reset(); the reset between calls removes it (kept ranks slowed 2.5x in an
    hour of the suite as the garbage collector walked every graph they had compiled)."""
    with keep_ranks():
        assert run_distributed(_one_trust_cell, 2, timeout=300) == ["ok", "ok"]
        assert run_distributed(_graph_modules_alive, 2, timeout=120) == [0, 0]
