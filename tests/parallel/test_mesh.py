"""The (dp, cp, hp) mesh: placement, Double-Ring groups, validation, caching, layout on ranks."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from loong_compile._compat.distributed import resolve_process_group
from loong_compile.parallel.tokens import gather_sequence, mesh_token_indices, shard_batch
from loong_compile.errors import LoongMeshError
from loong_compile.parallel.mesh import init_mesh, rank_layout, ring_rank_lists
from loong_compile.testing import run_distributed

pytestmark = pytest.mark.multirank  # spawns gloo ranks (pytest -m 'not multirank' leaves it out)


def test_head_first_puts_hp_groups_on_consecutive_ranks():
    layout = rank_layout(2, 2, 2, "head_first")
    assert layout[0, 1, :].tolist() == [2, 3] and layout[1, 0, :].tolist() == [4, 5]
    assert layout[0, :, 1].tolist() == [1, 3]


def test_context_first_puts_cp_groups_on_consecutive_ranks():
    layout = rank_layout(2, 4, 2, "context_first")
    assert layout[0, :, 1].tolist() == [4, 5, 6, 7] and layout[1, :, 0].tolist() == [8, 9, 10, 11]
    assert layout[0, 2, :].tolist() == [2, 6]


def test_double_ring_groups():
    rings = ring_rank_lists([10, 11, 12, 13, 14, 15], 2)
    assert rings["kv_inner"] == rings["dkv_inner"] == [[10, 11], [12, 13], [14, 15]]
    assert rings["kv_outer"] == [[10, 12, 14], [11, 13, 15]]
    assert rings["dkv_outer"] == [[10, 11, 12, 13, 14, 15]]


def test_single_process_mesh_without_distributed():
    mesh = init_mesh()
    assert init_mesh(hp=1, cp=1, dp=1) is mesh
    assert (mesh.dp, mesh.hp, mesh.cp, mesh.sp, mesh.coords()) == (1, 1, 1, 1, (0, 0, 0))
    kwargs = mesh.attention_kwargs()
    assert all(isinstance(v, (int, str)) for v in kwargs.values())


@pytest.mark.parametrize("kwargs,match", [
    (dict(hp=2), "needs an initialised process group"),
    (dict(cp=4, inner_ring=3), "must divide cp"),
    (dict(placement="diagonal"), "placement is one of"),
    (dict(hp=0), "integers >= 1"),
    (dict(cp=True), "integers >= 1"),
])
def test_bad_mesh_arguments(kwargs, match):
    with pytest.raises(LoongMeshError, match=match):
        init_mesh(**kwargs)


CONFIGS = [(2, 2, "head_first", 1), (2, 2, "context_first", 2), (1, 4, "head_first", 2),
           (4, 1, "head_first", 1), (1, 2, "context_first", 2), (1, 1, "head_first", 1)]


def _mesh_facts(rank, world):
    """Per config: coordinates, the ranks of this rank's groups, cache hits, a logged plan."""
    logging.getLogger("loong_compile.parallel.mesh").setLevel(logging.DEBUG)
    records = []
    logged = []
    handler = logging.Handler()
    handler.emit = lambda record: logged.append(record.getMessage())
    logging.getLogger("loong_compile.parallel.mesh").addHandler(handler)
    for hp, cp, placement, w in CONFIGS:
        mesh = init_mesh(hp=hp, cp=cp, placement=placement, inner_ring=w)
        groups = {kind: dist.get_process_group_ranks(resolve_process_group(name))
                  if name else [rank] for kind, name in mesh.group_names.items()}
        records.append({
            "coords": mesh.coords(), "dp": mesh.dp, "groups": groups,
            "cached": init_mesh(hp=hp, cp=cp, placement=placement, inner_ring=w,
                                dp=world // (hp * cp)) is mesh,
            "device_mesh": mesh.device_mesh.mesh.tolist(), "layout": mesh.layout.tolist(),
            "kwargs": mesh.attention_kwargs()})
    return records, logged


def _layout_round_trip(rank, world):
    """shard_batch -> gather_sequence gives back the batch; summed local losses = full loss."""
    results = []
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 50, (2, 24), generator=gen)
    logits = torch.randn(2, 24, 50, generator=gen, dtype=torch.float64)
    for hp, cp, placement, w in CONFIGS:
        mesh = init_mesh(hp=hp, cp=cp, placement=placement, inner_ring=w)
        batch = shard_batch(ids, ids.clone(), mesh)
        local_logits = logits[:, mesh_token_indices(24, mesh)]
        loss = F.cross_entropy(local_logits.flatten(0, 1), batch.labels.flatten(), reduction="sum")
        if mesh.sp > 1:
            dist.all_reduce(loss, group=resolve_process_group(mesh.group_names["sp"]))
        full_loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten(),
                                    reduction="sum")
        results.append({
            "ids": torch.equal(gather_sequence(batch.input_ids, mesh), ids),
            "positions": torch.equal(gather_sequence(batch.position_ids, mesh),
                                     torch.arange(24).expand(2, 24)),
            "labels": torch.equal(gather_sequence(batch.labels, mesh)[:, :-1], ids[:, 1:]),
            "logits": torch.equal(gather_sequence(local_logits, mesh, dim=1), logits),
            "loss": abs(loss.item() - full_loss.item()) <= 1e-9 * abs(full_loss.item())})
    return results


def _suite(rank, world):
    return _mesh_facts(rank, world), _layout_round_trip(rank, world)


@pytest.fixture(scope="module")
def four_ranks():
    return run_distributed(_suite, 4, timeout=180)


@pytest.mark.slow
def test_groups_follow_placement_and_rings(four_ranks):
    for rank, ((records, _), _) in enumerate(four_ranks):
        for (hp, cp, placement, w), facts in zip(CONFIGS, records):
            layout = rank_layout(4 // (hp * cp), cp, hp, placement)
            d, c, h = facts["coords"]
            assert layout[d, c, h] == rank and facts["layout"] == layout.tolist()
            assert facts["device_mesh"] == layout.tolist()
            groups = facts["groups"]
            assert groups["hp"] == layout[d, c, :].tolist()
            assert groups["cp"] == layout[d, :, h].tolist()
            line = layout[d, :, h].tolist()
            i, j = divmod(c, w)
            assert groups["kv_inner"] == groups["dkv_inner"] == line[i * w:(i + 1) * w]
            assert groups["kv_outer"] == line[j::w]
            assert groups["dkv_outer"] == line
            assert groups["sp"] == sorted(layout[d].flatten().tolist())
            assert facts["cached"]


@pytest.mark.slow
def test_attention_kwargs_are_primitives_and_plan_is_logged(four_ranks):
    (records, logged), _ = four_ranks[0]
    for facts in records:
        assert set(facts["kwargs"]) == {"hp", "cp", "inner_ring", "hp_group", "kv_inner_group",
                                        "kv_outer_group", "dkv_inner_group", "dkv_outer_group"}
        assert all(type(v) in (int, str) for v in facts["kwargs"].values())
    # one plan per distinct mesh, naming the ranks of every group
    assert len(logged) == len(CONFIGS)
    assert "kv_outer  groups: [[0, 2], [1, 3]]" in logged[2]  # hp=1, cp=4, w=2


@pytest.mark.slow
def test_shard_and_gather_round_trip_and_loss(four_ranks):
    for _, round_trip in four_ranks:
        for config, checks in zip(CONFIGS, round_trip):
            assert all(checks.values()), (config, checks)
