"""``reduce_gradients`` and ``set_fsdp_gradient_divide_factor`` equal per-parameter all-reduce
(sum over the sequence's ranks, mean over the dp replicas), on gloo ranks with dp > 1.

Each rank's gradients are drawn from its rank, so every rank can also compute the exact answer
itself.  With values on a grid of halves the sums are exact in any order, so the bucketed call
must equal both the per-parameter all-reduce and that answer bit for bit; with arbitrary values
the collective's summation order may differ between one flat buffer and separate tensors (as in
DistributedDataParallel), so they are compared to float rounding.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import loong_compile as lc
from loong_compile.errors import LoongConfigError, LoongRankMismatchError
from loong_compile.parallel.gradients import DEFAULT_BUCKET_BYTES
from loong_compile.testing import run_distributed

pytestmark = pytest.mark.multirank  # spawns gloo ranks (pytest -m 'not multirank' leaves it out)

SHAPES = [(3, 5), (7,), (4, 4, 2), (33,), (2, 300), (1,)]
DTYPES = {"float32": [torch.float32], "float64": [torch.float64],
          "mixed": [torch.float32, torch.float64, torch.bfloat16]}
TOLERANCE = {torch.float32: 1e-6, torch.float64: 1e-15, torch.bfloat16: 1e-2}
TIMEOUT = 600


def rank_gradients(rank: int, kind: str, on_grid: bool) -> list[torch.Tensor]:
    """Rank ``rank``'s gradient of each parameter (dtypes cycle through ``DTYPES[kind]``)."""
    g = torch.Generator().manual_seed(100 + rank)
    out = []
    for i, shape in enumerate(SHAPES):
        dtype = DTYPES[kind][i % len(DTYPES[kind])]
        x = torch.randint(-4, 5, shape, generator=g) / 2 if on_grid else torch.randn(shape, generator=g)
        out.append(x.to(dtype))
    return out


def parameters_with(grads: list[torch.Tensor], transposed: bool = False) -> list[torch.nn.Parameter]:
    params = [torch.nn.Parameter(torch.zeros_like(x)) for x in grads]
    for p, x in zip(params, grads):
        # a non-contiguous gradient (a transposed buffer) must be written back in place too
        p.grad = x.t().contiguous().t() if transposed and x.dim() == 2 else x.clone()
    return params


def reduce_worker(rank: int, world: int, layouts: list[tuple[int, int]], with_fsdp: bool) -> dict:
    out = {"cases": [], "errors": {}}
    for hp, cp in layouts:
        mesh = lc.init_mesh(hp=hp, cp=cp)
        for kind in DTYPES:
            for on_grid in (True, False):
                for bucket_bytes in (64, DEFAULT_BUCKET_BYTES):     # 64: a bucket per few tensors
                    grads = rank_gradients(rank, kind, on_grid)
                    per_parameter = parameters_with(grads)
                    for p in per_parameter:
                        dist.all_reduce(p.grad)
                        p.grad /= mesh.dp
                    bucketed = parameters_with(grads, transposed=True)
                    lc.reduce_gradients(bucketed, mesh, bucket_bytes=bucket_bytes)
                    exact = [sum(rank_gradients(r, kind, on_grid)[i].double() for r in range(world)) / mesh.dp
                             for i in range(len(SHAPES))]
                    out["cases"].append({
                        "case": (hp, cp, mesh.dp, kind, on_grid, bucket_bytes),
                        "dtypes": [p.grad.dtype for p in bucketed],
                        "equal": [torch.equal(a.grad, b.grad) for a, b in zip(per_parameter, bucketed)],
                        "exact": [torch.equal(b.grad, e.to(b.grad.dtype)) for b, e in zip(bucketed, exact)],
                        "error": [((a.grad - b.grad).abs().max() / a.grad.abs().max()).item()
                                  for a, b in zip(per_parameter, bucketed)],
                    })
    mesh = lc.init_mesh(hp=layouts[0][0], cp=layouts[0][1])
    params = parameters_with(rank_gradients(rank, "float32", True))
    # frozen, with a gradient kept from before (on rank 0 only): neither summed nor a mismatch
    frozen = torch.nn.Parameter(torch.ones(3), requires_grad=False)
    frozen.grad = torch.full((3,), 2.0) if rank == 0 else None
    params.append(frozen)
    params.append(torch.nn.Parameter(torch.ones(3)))          # no gradient on any rank: left alone
    lc.reduce_gradients(params, mesh)
    out["untouched_stays_none"] = params[-1].grad is None
    out["frozen_untouched"] = (frozen.grad is None if rank else torch.equal(frozen.grad, torch.full((3,), 2.0)))
    params[-1].grad = torch.ones(3) if rank == 0 else None    # a gradient on rank 0 only
    try:
        lc.reduce_gradients(params, mesh)
    except LoongRankMismatchError as exc:
        out["errors"]["mismatch"] = str(exc)
    if with_fsdp:
        out["fsdp"] = fsdp_checks(rank, world, mesh)
    return out


def linear_model(dtype: torch.dtype, on_grid: bool, frozen: bool = False) -> torch.nn.Module:
    g = torch.Generator().manual_seed(7)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4)).to(dtype)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randint(-4, 5, p.shape, generator=g) / 4 if on_grid else torch.randn(p.shape, generator=g))
    model[0].weight.requires_grad_(not frozen)
    return model


def local_loss(model: torch.nn.Module, rank: int, dtype: torch.dtype, on_grid: bool) -> torch.Tensor:
    """A loss that differs per rank (its tokens), linear in the output so grid values stay exact."""
    g = torch.Generator().manual_seed(200 + rank)
    x, target = ((torch.randint(-4, 5, s, generator=g) / 4 if on_grid else torch.randn(s, generator=g)).to(dtype)
                 for s in ((3, 8), (3, 4)))
    return (model(x) * target).sum()


def fsdp_checks(rank: int, world: int, mesh) -> dict:
    """FSDP2 with the divide factor set against replicated parameters with reduce_gradients."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    out = {}
    for dtype, on_grid in ((torch.float64, True), (torch.float32, False)):
        # float32: the first weight frozen (an adapter's base): FSDP2 reduces what trains only
        frozen = dtype == torch.float32
        replicated = linear_model(dtype, on_grid, frozen)
        local_loss(replicated, rank, dtype, on_grid).backward()
        lc.reduce_gradients(replicated, mesh)
        sharded = linear_model(dtype, on_grid, frozen)
        world_mesh = init_device_mesh("cpu", (world,))
        for layer in sharded:
            fully_shard(layer, mesh=world_mesh)
        fully_shard(sharded, mesh=world_mesh)
        lc.set_fsdp_gradient_divide_factor(sharded, mesh)
        local_loss(sharded, rank, dtype, on_grid).backward()
        trained = [(a, b) for a, b in zip(replicated.parameters(), sharded.parameters())
                   if a.requires_grad]
        assert all(p.grad is None for p in [*replicated.parameters(), *sharded.parameters()]
                   if not p.requires_grad)
        assert len(trained) == 4 - frozen
        pairs = [(a.grad, b.grad.full_tensor()) for a, b in trained]
        out[str(dtype)] = {"equal": [torch.equal(a, b) for a, b in pairs],
                           "error": [((a - b).abs().max() / a.abs().max()).item() for a, b in pairs]}
        try:
            lc.reduce_gradients(sharded, mesh)
        except LoongConfigError as exc:
            out["refused"] = str(exc)
    return out


def check(result: dict, world: int) -> None:
    assert result["cases"]
    for case in result["cases"]:
        (hp, cp, dp, kind, on_grid, bucket_bytes), label = case["case"], case["case"]
        assert dp * hp * cp == world
        if on_grid:                        # exact sums: bit for bit, and the exact answer
            assert all(case["equal"]) and all(case["exact"]), label
        else:
            for dtype, error in zip(case["dtypes"], case["error"]):
                assert error <= TOLERANCE[dtype], (label, dtype, error)
    assert result["untouched_stays_none"] and result["frozen_untouched"]
    assert "have a gradient on some ranks only" in result["errors"]["mismatch"]


@pytest.fixture(scope="module")
def four_ranks() -> list[dict]:
    # dp=2 x sp=2 (hp=2), dp=1 x sp=4, dp=4 x sp=1
    return run_distributed(reduce_worker, 4, [(2, 1), (2, 2), (1, 1)], True, timeout=TIMEOUT)


@pytest.mark.slow
def test_reduce_gradients_equals_per_parameter_all_reduce_on_four_ranks(four_ranks):
    for result in four_ranks:
        check(result, 4)
    dps = {case["case"][2] for case in four_ranks[0]["cases"]}
    assert dps == {1, 2, 4}


@pytest.mark.slow
def test_fsdp2_divide_factor_equals_reduce_gradients(four_ranks):
    """FSDP2 on gloo/CPU: reduce-scatter over the world, summed, divided by dp (= 2 here)."""
    for result in four_ranks:
        fsdp = result["fsdp"]
        assert all(fsdp["torch.float64"]["equal"]), fsdp
        assert max(fsdp["torch.float32"]["error"]) <= 1e-6, fsdp
        assert "FSDP2 reduces its own gradients" in fsdp["refused"]


@pytest.mark.slow
def test_reduce_gradients_on_eight_ranks_dp2_hp2_cp2():
    for result in run_distributed(reduce_worker, 8, [(2, 2)], False, timeout=TIMEOUT):
        check(result, 8)
