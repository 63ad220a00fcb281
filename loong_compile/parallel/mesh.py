"""The device mesh of 2D-Attention: ``dp × cp × hp`` ranks, placement, Double-Ring groups.

``sp = hp·cp`` ranks share one sequence (LoongTrain §4.1); ``world = dp·sp``.
The mesh tensor (global rank at each ``(dp, cp, hp)`` coordinate, from
``layout.rank_of``) is what the groups below are read off; the sizes are
checked against ``layout``'s rules and the world size.

* ``head_first``: the ranks of one HP group are consecutive (the all-to-all
  stays inside a node); ``context_first``: those of one CP group are (§4.4).
* Each CP group is cut into ``cp / w`` inner rings of ``w`` consecutive CP
  ranks; the rings at the same position ``j`` form the outer rings (§4.3).
  KV travels on the ``kv_inner`` / ``kv_outer`` groups; the gradients dK/dV
  have their own ``dkv_inner`` group and a ``dkv_outer`` group spanning the
  CP group (their last hop of an inner ring goes to ``(i+1, j+1)``, see
  ops/attention/ring.py), so backward traffic never queues behind KV on one communicator.

Every ring group is created with its ranks in ring order, so a rank's position
in the ring is its rank in the group.
"""

from __future__ import annotations

import functools
import itertools
import logging
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from loong_compile import _compat
from loong_compile._compat.distributed import new_group_in_order, register_group_alias
from loong_compile.checks import ranks as rank_check
from loong_compile.errors import LoongMeshError
from loong_compile.parallel.rules import PLACEMENTS, inner_ring_violation, rank_of

log = logging.getLogger(__name__)

MESH_DIMS = ("dp", "cp", "hp")

# the ring groups of one CP group, in the order they are created
RING_GROUPS = ("kv_inner", "kv_outer", "dkv_inner", "dkv_outer")


def rank_layout(dp: int, cp: int, hp: int, placement: str) -> torch.Tensor:
    """Global rank at each ``(dp, cp, hp)`` coordinate (``layout.rank_of``)."""
    return torch.tensor([[[rank_of(d, c, h, cp, hp, placement) for h in range(hp)]
                          for c in range(cp)] for d in range(dp)], dtype=torch.int64)


def ring_rank_lists(cp_line: list[int], inner_ring: int) -> dict[str, list[list[int]]]:
    """The ring groups of one CP group (its global ranks in CP order), each in ring order."""
    w = inner_ring
    n_outer = len(cp_line) // w
    inner = [cp_line[i * w:(i + 1) * w] for i in range(n_outer)]
    outer = [cp_line[j::w] for j in range(w)]
    return {"kv_inner": inner, "kv_outer": outer, "dkv_inner": inner, "dkv_outer": [cp_line]}


@dataclass(frozen=True, eq=False)
class LoongMesh:
    """Sizes, this rank's coordinates and the process groups (by name) of a 2D-Attention mesh."""

    dp: int
    hp: int
    cp: int
    inner_ring: int
    placement: str
    rank: int
    layout: torch.Tensor                       # (dp, cp, hp) -> global rank
    device_mesh: object | None                 # torch DeviceMesh, dims ("dp", "cp", "hp")
    group_names: dict[str, str]                # kind -> this rank's group name ("" = size 1)
    group_ranks: dict[str, list[list[int]]]    # kind -> every group of that kind, in ring order
    _world: object | None = field(default=None, repr=False)

    @property
    def sp(self) -> int:
        return self.hp * self.cp

    @property
    def world(self) -> int:
        return self.dp * self.sp

    @property
    def sp_ranks(self) -> list[int]:
        """The global ranks that share this rank's sequence (its replica), in rank order."""
        return self.group_ranks["sp"][self.dp_rank]

    @property
    def outer_ring(self) -> int:
        return self.cp // self.inner_ring

    def coords(self, rank: int | None = None) -> tuple[int, int, int]:
        """``(dp_rank, cp_rank, hp_rank)`` of ``rank`` (default: this rank)."""
        return self._coords[self.rank if rank is None else rank]

    @functools.cached_property
    def _coords(self) -> dict[int, tuple[int, int, int]]:
        ranks = self.layout.tolist()
        positions = itertools.product(*map(range, self.layout.shape))
        return {ranks[d][c][h]: (d, c, h) for d, c, h in positions}

    @property
    def dp_rank(self) -> int:
        return self.coords()[0]

    @property
    def cp_rank(self) -> int:
        return self.coords()[1]

    @property
    def hp_rank(self) -> int:
        return self.coords()[2]

    def attention_kwargs(self) -> dict[str, object]:
        """Keyword arguments of ``loong_compile.ops.attention_2d`` (ints and group names)."""
        return {
            "hp": self.hp, "cp": self.cp, "inner_ring": self.inner_ring,
            "hp_group": self.group_names["hp"],
            **{f"{kind}_group": self.group_names[kind] for kind in RING_GROUPS},
        }

    def document_kwargs(self) -> dict[str, object]:
        """Keyword arguments of ``loong_compile.ops.sequence_document_ids``."""
        return {"hp": self.hp, "cp": self.cp, "sp_group": self.group_names["sp"],
                "hp_group": self.group_names["hp"], "cp_group": self.group_names["dkv_outer"]}

    def scan_kwargs(self, heads_split: bool = False) -> dict[str, object]:
        """Keyword arguments of the ops of token mixers with a state (``ops/scans/causal_conv.py``,
        ``ops/scans/gated_scan.py``): over the ranks of the sequence, each holding its tokens as the
        layout gives them, or (``heads_split``: after the head all-to-all) over the CP group,
        each rank holding its whole CP shard.  ``places``: each group rank's (cp rank, hp rank);
        ``group_rank``: this rank's in the group."""
        if heads_split:
            return {"hp": 1, "cp": self.cp, "places": [(c, 0) for c in range(self.cp)],
                    "group_rank": self.cp_rank, "scan_group": self.group_names["dkv_outer"]}
        return {"hp": self.hp, "cp": self.cp, "places": [self.coords(r)[1:] for r in self.sp_ranks],
                "group_rank": self.sp_ranks.index(self.rank), "scan_group": self.group_names["sp"]}

    def describe(self) -> str:
        """The plan: sizes and the ranks of every group."""
        lines = [f"LoongMesh dp={self.dp} cp={self.cp} hp={self.hp} inner_ring={self.inner_ring} "
                 f"outer_ring={self.outer_ring} placement={self.placement} world={self.world}"]
        lines += [f"  {kind:9s} groups: {ranks}" for kind, ranks in self.group_ranks.items()]
        return "\n".join(lines)


_CACHE: dict[tuple, LoongMesh] = {}
_USER_MESHES: list[LoongMesh] = []   # built by init_mesh: the meshes batches are cut with


def init_mesh(hp: int = 1, cp: int = 1, placement: str = "head_first", inner_ring: int = 1,
              dp: int | None = None, *, rank_check_timeout: float | None = None) -> LoongMesh:
    """The (cached) mesh for these sizes: the one ``shard_batch`` cuts a batch with.

    Works with an initialised default process group, and without one when
    ``hp = cp = 1`` (a single-process mesh with no groups).  Raises
    ``LoongMeshError`` before creating any group when the sizes do not fit, and
    ``LoongRankMismatchError`` when ranks ask for different meshes, after at most
    ``rank_check_timeout`` seconds (default: ``LOONG_RANK_CHECK_TIMEOUT``, else 300).
    The backend's options must then describe one of the meshes built here.
    """
    if rank_check_timeout is None:
        from loong_compile.config import LoongConfig

        rank_check_timeout = LoongConfig.from_options().rank_check_timeout
    mesh = _cached_mesh(hp, cp, placement, inner_ring, dp, rank_check_timeout)
    if mesh not in _USER_MESHES:
        _USER_MESHES.append(mesh)
    return mesh


def mesh_for_options(config) -> LoongMesh:
    """The mesh the backend runs on for ``config`` (a ``LoongConfig``).

    Raises ``LoongMeshError`` when ``init_mesh`` built meshes in this process
    group and none has the options' layout: the batch was then cut for another
    layout than the one attention assumes, and every result would be wrong.
    """
    return _cached_mesh(config.hp, config.cp, config.placement, config.inner_ring, None,
                        config.rank_check_timeout, against_user_meshes=True)


def one_process_mesh(placement: str = "head_first") -> LoongMesh:
    """The mesh of one process without a process group (hp = cp = dp = 1, no groups): built
    as is, with none of ``init_mesh``'s agreement or checks, which have no other rank."""
    return _build(1, 1, placement, 1, 1, None)


def _cached_mesh(hp, cp, placement, inner_ring, dp, timeout: float,
                 against_user_meshes: bool = False) -> LoongMesh:
    request = {"hp": hp, "cp": cp, "placement": placement, "inner_ring": inner_ring, "dp": dp}
    # announced first: ranks whose agreement never meets this rank name what it asked for
    rank_check.announce("mesh", request)
    world_group = dist.group.WORLD if dist.is_initialized() else None
    asked = (hp, cp, placement, inner_ring, dp)
    if not _is_cached(asked, world_group):
        # ranks asking for different meshes would create groups no one else matches: a hang.
        # Agreed before validating, so that a request only some ranks refuse raises everywhere.
        rank_check.check_agreement("mesh", request, timeout)
    world = dist.get_world_size() if dist.is_initialized() else 1
    dp = _validate(hp, cp, placement, inner_ring, dp, world)
    if against_user_meshes:
        _check_against_user_meshes(hp, cp, placement, world_group)
    key = (hp, cp, placement, inner_ring, dp)
    if not _is_cached(key, world_group):
        _CACHE[key] = _build(hp, cp, placement, inner_ring, dp, world_group)
        log.debug("%s", _CACHE[key].describe())
    _CACHE[asked] = _CACHE[key]
    return _CACHE[key]


def _is_cached(key: tuple, world_group) -> bool:
    mesh = _CACHE.get(key)
    return mesh is not None and mesh._world is world_group


def _check_against_user_meshes(hp: int, cp: int, placement: str, world_group) -> None:
    """The options' layout (hp, cp, placement: what decides which tokens a rank holds) must be
    that of a mesh ``init_mesh`` built in this process group, if it built any."""
    built = [m for m in _USER_MESHES if m._world is world_group]
    if not built or any((m.hp, m.cp, m.placement) == (hp, cp, placement) for m in built):
        return
    meshes = ", ".join(f"init_mesh(hp={m.hp}, cp={m.cp}, placement={m.placement!r})" for m in built)
    first = built[-1]
    raise LoongMeshError(
        f"options hp={hp}, cp={cp}, placement={placement!r} but this process built {meshes}",
        "the backend's options describe the mesh the batch was cut with (shard_batch): "
        "another layout gives each rank other tokens than attention assumes",
        f"pass options with hp={first.hp}, cp={first.cp}, placement={first.placement!r} "
        f"(or build the mesh with the options' sizes)")


def _validate(hp, cp, placement, inner_ring, dp, world) -> int:
    """Check the sizes against the world; return dp."""
    sizes = {"hp": hp, "cp": cp, "inner_ring": inner_ring, **({} if dp is None else {"dp": dp})}
    for name, value in sizes.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise LoongMeshError(f"{name}={value!r}", "mesh sizes are integers >= 1",
                                 f"pass a positive integer for {name}")
    if placement not in PLACEMENTS:
        raise LoongMeshError(f"placement={placement!r}", f"placement is one of {PLACEMENTS}",
                             "use 'head_first' (HP group on consecutive ranks) or 'context_first'")
    violation = inner_ring_violation(cp, inner_ring)
    if violation:
        raise LoongMeshError(*violation)
    sp = hp * cp
    if not dist.is_initialized() and (sp > 1 or (dp or 1) > 1):
        raise LoongMeshError(f"hp={hp}, cp={cp}, dp={dp} without torch.distributed",
                             "a mesh of more than one rank needs an initialised process group",
                             "call torch.distributed.init_process_group() first (e.g. under "
                             "torchrun), or use hp=cp=1")
    if world % sp:
        fits = [(h, world // h) for h in range(1, world + 1) if world % h == 0]
        raise LoongMeshError(f"world size {world} with hp*cp = {hp}*{cp} = {sp}",
                             "the world size must be a multiple of hp*cp",
                             f"choose hp*cp dividing {world}, e.g. (hp, cp) in {fits}")
    if dp is not None and dp * sp != world:
        raise LoongMeshError(f"dp={dp} with hp*cp = {sp} on world size {world}",
                             "dp*hp*cp must equal the world size",
                             f"pass dp={world // sp} or leave dp=None")
    return world // sp


def _build(hp, cp, placement, inner_ring, dp, world_group) -> LoongMesh:
    layout = rank_layout(dp, cp, hp, placement)
    if world_group is None:  # one process, nothing to communicate
        trivial = {kind: [[0]] for kind in ("hp", "cp", "sp", *RING_GROUPS)}
        return LoongMesh(dp, hp, cp, inner_ring, placement, 0, layout, None,
                         {kind: "" for kind in trivial}, trivial, None)

    from torch.distributed.device_mesh import DeviceMesh

    backend = str(dist.get_backend())
    device_type = "cuda" if "nccl" in backend and torch.cuda.is_available() else "cpu"
    device_mesh = DeviceMesh(device_type, layout, mesh_dim_names=MESH_DIMS)
    rank = dist.get_rank()
    names = {"hp": device_mesh.get_group("hp").group_name,
             "cp": device_mesh.get_group("cp").group_name}
    ranks = {"hp": [layout[d, c, :].tolist() for d in range(dp) for c in range(cp)],
             "cp": [layout[d, :, h].tolist() for d in range(dp) for h in range(hp)],
             "sp": [sorted(layout[d].flatten().tolist()) for d in range(dp)]}
    cp_lines = ranks["cp"]
    for kind in RING_GROUPS:
        ranks[kind] = [ring for line in cp_lines
                       for ring in ring_rank_lists(line, inner_ring)[kind]]
    for kind in ("sp", *RING_GROUPS):
        names[kind] = _new_groups(ranks[kind], rank, f"loong_{kind}")
    # the graphs name groups by what they are, the same on every rank (ops resolve them by name)
    tag = f"{dp}x{cp}x{hp}:{placement}:ring{inner_ring}"
    names = {kind: register_group_alias(f"loong_{kind}:{tag}", name) if name else ""
             for kind, name in names.items()}
    return LoongMesh(dp, hp, cp, inner_ring, placement, rank, layout, device_mesh, names, ranks,
                     world_group)


def _new_groups(rank_lists: list[list[int]], rank: int, desc: str) -> str:
    """Create every group of one kind (all ranks call this); return the name of ``rank``'s.

    Ranks are kept in the given (ring) order; groups of one rank are not created.
    """
    mine = ""
    for ranks in rank_lists:
        if len(ranks) == 1:
            continue
        if ranks != sorted(ranks) and not _compat.has("unsorted_process_groups"):
            raise LoongMeshError(
                f"{desc}: the ring order {ranks}",
                f"torch {torch.__version__} builds process groups in sorted rank order only "
                "(capability unsorted_process_groups, torch >= 2.12), and this ring is not "
                "in ascending order", "use placement='head_first' and inner_ring=1, or "
                "torch >= 2.12")
        group = new_group_in_order(ranks, desc)
        if rank in ranks:
            mine = group.group_name
            if dist.get_process_group_ranks(group) != ranks:
                raise RuntimeError(f"{desc}: group ranks {dist.get_process_group_ranks(group)} "
                                   f"lost the ring order {ranks}")
    return mine
