"""What the backend receives is checked before any collective, on every rank (issue 10, obs 5-7).

* the options against the mesh the batch was cut with (``init_mesh``);
* each call's ``position_ids`` against the token layout (``data.layout_positions``);
* the mesh and options the ranks ask for against each other, within ``rank_check_timeout``;
* one graph for every rank of a sequence when its length changes at batch size 1, and the
  compile check within the sequence's ranks only (data-parallel replicas may differ).

Two spawns: four ranks for what must run exactly or be refused, two ranks for ranks that
disagree (those leave the ranks' agreement rounds out of step, so they run alone).
"""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import loong_compile as lc
from helpers import error_of, still_in_step
from loong_compile._compat.distributed import resolve_process_group
from loong_compile.parallel.tokens import local_token_indices, mesh_token_indices
from loong_compile.checks.positions import Verdict, classify, describe, refused
from loong_compile.testing import run_distributed

pytestmark = pytest.mark.multirank  # spawns gloo ranks (pytest -m 'not multirank' leaves it out)

RANK_CHECK_TIMEOUT = 3      # seconds: the ranks that disagree wait this long
SPAWN_TIMEOUT = 240         # well under the default rank-check timeout (300 s) a hang would take
SEQ = 16


def _model():
    from llama import Llama, LlamaConfig

    torch.manual_seed(0)
    return Llama(LlamaConfig(dim=32, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=64)).double()


def _loss(logits, labels, count):
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100,
                           reduction="sum") / count


def _ids(batch, seq, seed=0):
    return torch.randint(0, 256, (batch, seq), generator=torch.Generator().manual_seed(seed))


def _reference(ids, position_ids=None) -> float:
    """One process, the full sequence, float64."""
    logits = _model()(ids, position_ids=position_ids)
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten()).item()


def _distributed_loss(compiled, ids, mesh, position_ids=None, dynamic=False) -> float:
    """The loss summed over the ranks (each feeds its shard) for one replica's ``ids``."""
    shard = lc.shard_batch(ids, ids, mesh)
    if dynamic:  # exactly as docs/usage.md shows
        torch._dynamo.mark_dynamic(shard.input_ids, 1)
        torch._dynamo.mark_dynamic(shard.position_ids, 1)
    positions = shard.position_ids if position_ids is None else position_ids
    loss = _loss(compiled(shard.input_ids, position_ids=positions), shard.labels,
                 ids.shape[0] * (ids.shape[1] - 1)).detach()
    dist.all_reduce(loss, group=resolve_process_group(mesh.group_names["sp"]))
    return loss.item()


def _compiled(options, on_report=None):
    torch._dynamo.reset()
    backend = lc.LoongBackend({"lowering": "eager", **options}, on_report=on_report)
    return torch.compile(_model(), backend=backend, fullgraph=True)


def received(rank: int, world: int) -> dict:
    """Four ranks: each scenario's error (or losses), then whether the ranks are still in step."""
    out = {}
    hp2cp2 = {"hp": 2, "cp": 2}
    mesh = lc.init_mesh(**hp2cp2)
    ids = _ids(2, SEQ)
    shard = lc.shard_batch(ids, ids, mesh)
    local = shard.input_ids.shape[1]

    # obs 5a: the batch is cut for hp=2, cp=2; the options say hp=2, cp=1
    out["options_vs_mesh"] = error_of(lambda: _compiled({"hp": 2, "cp": 1})(
        shard.input_ids, position_ids=shard.position_ids))
    out["options_vs_mesh_ok"] = still_in_step()
    # obs 5b/5c: position ids that are not the layout's
    bad_positions = {
        # the rank's own tokens counted from 0 (positions made from the local length)
        "positions_local": torch.arange(local).expand(2, -1),
        # shard_batch not called: every rank feeds the whole sequence, positions 0..S-1
        "no_shard_batch": None,
        # cut for another layout (hp=4, cp=1)
        "other_layout": local_token_indices(SEQ, 1, 4, 0, rank).expand(2, -1),
    }
    for name, positions in bad_positions.items():
        compiled = _compiled(hp2cp2)
        if positions is None:
            run = lambda: compiled(ids, position_ids=torch.arange(SEQ).expand(2, -1))  # noqa: E731
        else:
            run = lambda: compiled(shard.input_ids, position_ids=positions)  # noqa: E731
        out[name] = error_of(run)
        out[f"{name}_ok"] = still_in_step()
    # the layout's own positions run, exactly
    reports = []
    out["good"] = (_distributed_loss(_compiled(hp2cp2, reports.append), ids, mesh), _reference(ids))
    out["good_summary"] = reports[-1].summary("input_checks")
    # packed documents (positions restarting at 0, cut by the layout) run as one process runs
    # them: this model attends causally across documents, as its own forward does; a document
    # starting on the first token of the rank holding tokens 8-11 leaves it holding 0..3
    packed = torch.cat([torch.arange(8), torch.arange(8)]).expand(2, -1)
    out["packed"] = (_distributed_loss(_compiled(hp2cp2), ids, mesh, packed[:, mesh_token_indices(
        SEQ, mesh)]), _reference(ids, packed))

    # obs 7: batch size 1 and a second length (Dynamo makes the length dynamic), then
    # mark_dynamic as docs/usage.md shows: one graph on every rank, exact (and the token
    # analysis keeps the marked length symbolic)
    for name, dynamic in (("batch1_second_length", False), ("batch1_mark_dynamic", True)):
        compiled = _compiled({**hp2cp2, "lowering": "aot_eager"})
        out[f"{name}_losses"] = losses = []
        out[name] = error_of(lambda: losses.extend(
            (_distributed_loss(compiled, _ids(1, seq, seq), mesh, dynamic=dynamic),
             _reference(_ids(1, seq, seq))) for seq in (SEQ, 2 * SEQ)))
        out[f"{name}_ok"] = still_in_step()
    # obs 7: two data-parallel replicas (hp=2 each) with different lengths
    replicas = lc.init_mesh(hp=2)
    seq = SEQ * (1 + replicas.dp_rank)
    compiled = _compiled({"hp": 2, "lowering": "aot_eager"})
    out["replica_lengths_losses"] = losses = []
    out["replica_lengths"] = error_of(lambda: losses.append(
        (_distributed_loss(compiled, _ids(1, seq, seq), replicas), _reference(_ids(1, seq, seq)))))
    out["replica_lengths_ok"] = still_in_step()
    return out


def disagreeing(rank: int, world: int) -> dict:
    """Two ranks that ask for different meshes; nothing may wait longer than the timeout."""
    os.environ["LOONG_RANK_CHECK_TIMEOUT"] = str(RANK_CHECK_TIMEOUT)  # init_mesh's default
    out = {}
    timed = {}

    def attempt(name, fn):
        start = time.monotonic()
        out[name] = error_of(fn)
        timed[name] = time.monotonic() - start

    # init_mesh: a size only rank 0 asks for, which only rank 0's validation would refuse
    attempt("init_mesh_differs", lambda: lc.init_mesh(hp=3 if rank == 0 else 1, cp=2 - rank))
    # the backend's options: cp=2 on rank 1, which the world of 2 cannot hold with hp=2
    options = {"hp": 2, "cp": 1 + rank, "lowering": "eager", "rank_check_timeout": RANK_CHECK_TIMEOUT}
    x = _ids(1, SEQ // 2)
    attempt("options_differ", lambda: _compiled(options)(x, position_ids=torch.arange(SEQ // 2)[None]))
    # a mesh both built; options that differ by rank: rank 0's is cached, rank 1's is not,
    # so they never meet in one round and each sees the other wait (a timeout far beyond the
    # test's: neither may wait it out, however long rank 0 takes to reach its check)
    mesh = lc.init_mesh(hp=2)
    shard = lc.shard_batch(_ids(1, SEQ), None, mesh)
    differing = {"lowering": "eager", "hp": 2 - rank, "cp": 1 + rank}
    attempt("cached_mesh_differs", lambda: _compiled({**differing, "rank_check_timeout": 120})(
        shard.input_ids, position_ids=shard.position_ids))
    # the same, rank 0 late: rank 1 gives up on this compile after its timeout and goes on to
    # the next; rank 0 then names rank 1's reason instead of meeting rank 1's next compile
    def late():
        if rank == 0:
            time.sleep(RANK_CHECK_TIMEOUT + 2)
        return _compiled({**differing, "rank_check_timeout": RANK_CHECK_TIMEOUT})(
            shard.input_ids, position_ids=shard.position_ids)
    attempt("late_rank_gave_up", late)
    # issue 23 obs 3: rank 0 refuses its graph (no position_ids: the model's arange) before the
    # compile check; rank 1 compiles and waits there, with a timeout far beyond the test's
    options = {"hp": 2, "lowering": "eager", "rank_check_timeout": 120}
    positions = {} if rank == 0 else {"position_ids": shard.position_ids}
    attempt("refused_on_one_rank", lambda: _compiled(options)(shard.input_ids, **positions))
    dist.barrier()   # rank 0's process holds the store: it stays until rank 1 has raised
    return out, timed


@pytest.fixture(scope="module")
def four_ranks():
    return run_distributed(received, 4, timeout=SPAWN_TIMEOUT)


@pytest.fixture(scope="module")
def two_disagreeing_ranks():
    return run_distributed(disagreeing, 2, timeout=SPAWN_TIMEOUT)


REFUSED = {
    "options_vs_mesh": ("LoongMeshError", [
        "options hp=2, cp=1", "init_mesh(hp=2, cp=2", "fix: pass options with hp=2, cp=2"]),
    "positions_local": ("LoongShapeError", [
        "on ranks [1, 2, 3]", "count this rank's own tokens from 0", "shard_batch"]),
    "no_shard_batch": ("LoongShapeError", [
        "a 64-token sequence", "on ranks [1, 2, 3]", "position_ids=batch.position_ids"]),
    "other_layout": ("LoongShapeError", ["not those of the tokens the layout gives", "shard_batch"]),
}


def _assert_refused(results, scenario, error_class, fragments):
    for rank, out in enumerate(results):
        message = out[scenario]
        assert message.startswith(error_class + ":"), (rank, message)
        for fragment in fragments:
            assert fragment in message, (rank, fragment, message)
        assert "fix:" in message
        assert out[f"{scenario}_ok"] is True


@pytest.mark.slow
@pytest.mark.parametrize("scenario", sorted(REFUSED))
def test_what_the_backend_receives_is_refused_on_every_rank(four_ranks, scenario):
    _assert_refused(four_ranks, scenario, *REFUSED[scenario])


@pytest.mark.slow
@pytest.mark.parametrize("scenario", ["good", "packed"])
def test_the_layouts_positions_and_packed_documents_run_exactly(four_ranks, scenario):
    for out in four_ranks:
        loss, ref = out[scenario]
        assert abs(loss - ref) <= 1e-12 * abs(ref), (loss, ref)
        assert out["good_summary"]["matched"] == 1, out["good_summary"]


@pytest.mark.slow
@pytest.mark.parametrize("scenario", ["batch1_second_length", "batch1_mark_dynamic",
                                      "replica_lengths"])
def test_lengths_that_change_or_differ_between_replicas_stay_exact(four_ranks, scenario):
    for rank, out in enumerate(four_ranks):
        assert out[scenario] == "no error", (rank, out[scenario])
        assert out[f"{scenario}_ok"] is True
        for loss, ref in out[f"{scenario}_losses"]:
            assert abs(loss - ref) <= 1e-12 * abs(ref), (rank, loss, ref)


DISAGREEMENTS = {
    # rank 0 refuses its own request only after the ranks compared requests: no one waits
    "init_mesh_differs": ["mesh #0: the ranks differ", "cp=2 on ranks [0], cp=1 on ranks [1]",
                          "hp=3 on ranks [0], hp=1 on ranks [1]"],
    "options_differ": ["mesh #", "cp=1 on ranks [0], cp=2 on ranks [1]"],
    # rank 0 waits in the compile check, rank 1 in the mesh check: each sees the other's wait
    "cached_mesh_differs": ["check of the same compile",
                            "options: cp=1 on ranks [0], cp=2 on ranks [1]",
                            "hp=2 on ranks [0], hp=1 on ranks [1]"],
    # rank 1 waits out its 3 s; rank 0, late, reads why rank 1 gave up on this compile
    "late_rank_gave_up": ["did not within 3 s", "options: cp=1 on ranks [0], cp=2 on ranks [1]"],
}
LATE_RANK_NOTICE = {0: "rank 1 refused this compile: LoongRankMismatchError: rank 1 reached mesh #",
                    1: "rank 1 reached mesh #"}
# seconds each scenario may take: a few timeouts' worth (rank 0 arrives late in the last),
# far below the 120 s that cached_mesh_differs would wait out
WAITED_AT_ONCE = {"cached_mesh_differs": 30.0, "late_rank_gave_up": 30.0}


@pytest.mark.slow
@pytest.mark.parametrize("scenario", sorted(DISAGREEMENTS))
def test_ranks_that_disagree_on_the_mesh_name_the_difference_within_the_timeout(
        two_disagreeing_ranks, scenario):
    for rank, (out, timed) in enumerate(two_disagreeing_ranks):
        message = out[scenario]
        assert message.startswith("LoongRankMismatchError:"), (rank, message)
        for fragment in DISAGREEMENTS[scenario]:
            assert fragment in message, (rank, fragment, message)
        if scenario == "late_rank_gave_up":
            assert LATE_RANK_NOTICE[rank] in message, (rank, message)
        assert timed[scenario] < WAITED_AT_ONCE.get(scenario, 3 * RANK_CHECK_TIMEOUT), \
            (rank, timed[scenario])


@pytest.mark.slow
def test_a_rank_that_refuses_tells_the_waiting_ranks_within_seconds(two_disagreeing_ranks):
    """Rank 1 waits in the compile check (rank_check_timeout=120 s) for rank 0, which refused
    its graph before reaching it: rank 1 raises within seconds, naming rank 0's refusal."""
    (mine, mine_timed), (waiting, waiting_timed) = two_disagreeing_ranks
    assert mine["refused_on_one_rank"].startswith("LoongTokenMixingError:"), mine
    assert waiting["refused_on_one_rank"].startswith("LoongRankMismatchError:"), waiting
    assert "rank 0 refused this compile: LoongTokenMixingError" in waiting["refused_on_one_rank"]
    assert "fix:" in waiting["refused_on_one_rank"]
    assert waiting_timed["refused_on_one_rank"] < 10.0, waiting_timed


def test_verdicts_on_positions():
    expected = local_token_indices(16, 2, 2, 0, 1)     # 12..15
    def verdict(positions):  # (verdict, holds 0..S_local-1), made on the device
        found, holds_arange = classify(torch.tensor(positions), expected).tolist()
        return Verdict(found), bool(holds_arange)

    assert verdict([[12, 13, 14, 15], [12, 13, 14, 15]]) == (Verdict.OK, False)
    assert verdict([[0, 1, 2, 3]]) == (Verdict.LOCAL, True)
    assert verdict([[4, 5, 0, 1]]) == (Verdict.PACKED, False)
    assert verdict([[12, 13, 14, 16]]) == (Verdict.OTHER, False)
    assert verdict([[13, 14, 15, 16]]) == (Verdict.OTHER, False)
    assert describe(torch.tensor([0, 1, 2, 3, 12, 13, 20])) == "0-3, 12-13, 20"
    ok, packed, local, other = Verdict.OK, Verdict.PACKED, Verdict.LOCAL, Verdict.OTHER
    # a document starting on rank 1's first token: accepted; every rank counting from 0: not
    assert refused([ok, local, packed], [True, True, False]) == [False, False, False]
    assert refused([ok, local, local], [True, True, True]) == [False, True, True]
    assert refused([packed, other], [False, False]) == [False, True]
    assert describe(torch.arange(0, 20, 2), most=2) == "0, 2, ..."
    # within the global positions but not packed: perhaps the balanced order, let through only
    # to a graph that computes it exactly (sequence_document_ids verifies the rows there)
    assert verdict([[4, 5, 2, 7]]) == (Verdict.BALANCED, False)
    balanced = Verdict.BALANCED
    assert refused([packed, balanced], [False, False]) == [False, True]
    assert refused([packed, balanced], [False, False], balanced_exact=True) == [False, False]
