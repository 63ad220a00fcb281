"""Layout facts of 2D-Attention, in one torch-free place: the named choices (placements,
activation policies), which sizes fit together (sequence, heads, inner ring) and where a mesh
coordinate sits (rank of a coordinate, ring position of a CP rank); MEMO's categories of saved
values.

The backend (``config.py``, ``parallel/mesh.py``, ``parallel/tokens.py``, ``ops/``) and the estimator
(``estimate/``, ``cli/parser.py``) both read these, so ``loong plan`` refuses exactly what the
backend refuses.  A rule returns a ``Violation`` (value, rule, fix) or None; each caller raises
it as its own ``LoongError`` subclass (a config, mesh or shape error) or keeps it as the reason
a planned configuration was pruned.
"""

from __future__ import annotations

from typing import Literal, NamedTuple, get_args

Placement = Literal["head_first", "context_first"]
PLACEMENTS: tuple[str, ...] = get_args(Placement)
PLACEMENT_DOCS = {
    "head_first": "the ranks of one HP group are consecutive: the all-to-all stays inside a node",
    "context_first": "the ranks of one CP group are consecutive: the rings stay inside a node",
}

ActivationPolicy = Literal["none", "sc++", "memo", "full", "full_offload"]
ACTIVATION_POLICIES: tuple[str, ...] = get_args(ActivationPolicy)
ACTIVATION_POLICY_DOCS = {
    "none": "Inductor's partition decides what is saved",
    "sc++": "save layer inputs and attention outputs, recompute the rest (LoongTrain's SC++)",
    "memo": "offload saved values to the host, recompute token slices (MEMO)",
    "full": "save layer inputs only, recompute the rest, attention too",
    "full_offload": "save layer inputs only, on the host (MEMO's offload and prefetch); recompute "
                    "the rest, attention too",
}
ESTIMATED_POLICIES = ACTIVATION_POLICIES
# The policies whose saved layer values MEMO's passes offload to the host and prefetch
OFFLOADING_POLICIES = ("memo", "full_offload")
# MEMO's classes of a layer's saved values, as the activation passes report them and the
# estimator counts them: the layer's input, the attention's outputs (out, lse), the rest
CATEGORIES = ("input", "attention", "other")


class Violation(NamedTuple):
    """A size that does not fit: the value, the rule it breaks and the fix (``LoongError``'s)."""

    what: str
    rule: str
    fix: str


def divisors(n: int) -> list[int]:
    return [x for x in range(1, n + 1) if n % x == 0]


def sequence_divisor(cp: int, hp: int) -> int:
    """What the full sequence length must divide by: ``2·cp·hp`` (``hp`` when ``cp = 1``:
    without context parallelism there is no zigzag, the sequence is cut into ``hp`` pieces)."""
    return 2 * cp * hp if cp > 1 else hp


def sequence_violation(seq_len: int, cp: int, hp: int) -> Violation | None:
    """The layout cuts ``seq_len`` tokens into equal pieces on an ``hp x cp`` grid."""
    divisor = sequence_divisor(cp, hp)
    if seq_len % divisor == 0:
        return None
    rule = (f"the sequence length must be a multiple of 2*cp*hp = {divisor} (zigzag over "
            f"2*cp chunks, each CP shard split over hp ranks)" if cp > 1 else
            f"the sequence length must be a multiple of hp = {divisor}")
    return Violation(f"sequence length {seq_len} with cp={cp}, hp={hp}", rule,
                     f"pad or trim the sequence to a multiple of {divisor}, e.g. "
                     f"{-(-seq_len // divisor) * divisor}")


def inner_ring_violation(cp: int, inner_ring: int) -> Violation | None:
    """The Double-Ring cuts a CP group into ``cp / w`` inner rings of ``w`` ranks."""
    if cp % inner_ring == 0:
        return None
    return Violation(f"inner_ring={inner_ring} with cp={cp}",
                     "the inner ring size w must divide cp (cp/w inner rings)",
                     f"use inner_ring in {divisors(cp)}")


def head_violation(heads: int, kv_heads: int, hp: int) -> Violation | None:
    """Head parallelism splits the query heads evenly, and the KV heads either split too or
    are each replicated ``hp / kv_heads`` times (LoongTrain §4.2)."""
    if heads % kv_heads:
        return Violation(f"{heads} query heads with {kv_heads} KV heads",
                         "the query heads are a multiple of the KV heads (GQA groups)",
                         "use a KV head count that divides the query heads")
    if heads % hp:
        return Violation(f"{heads} query heads with hp={hp}",
                         "head parallelism splits the query heads evenly: H % hp == 0",
                         f"choose hp dividing {heads}")
    if kv_heads % hp and hp % kv_heads:
        return Violation(f"{kv_heads} KV heads with hp={hp}",
                         "either H_kv % hp == 0 (KV heads split) or hp % H_kv == 0 (each KV "
                         "head replicated hp/H_kv times, LoongTrain §4.2)",
                         f"choose hp dividing {kv_heads} or a multiple of it")
    return None


def head_group_choices(heads: int, kv_heads: int, hp: int) -> list[int]:
    """The head group counts 2D-Attention takes (ops/attention/head_groups.py): they divide
    the query heads a rank holds after the all-to-all, and divide its KV heads (after the
    replication of LoongTrain §4.2) or are a multiple of them, so that each group keeps whole
    KV heads or shares one."""
    local_q, local_kv = heads // hp, max(kv_heads, hp) // hp
    return [g for g in range(1, local_q + 1)
            if local_q % g == 0 and (local_kv % g == 0 or g % local_kv == 0)]


def head_group_violation(heads: int, kv_heads: int, hp: int, groups: int) -> Violation | None:
    """``groups`` must be one of ``head_group_choices`` (``kv_heads``: before replication)."""
    choices = head_group_choices(heads, kv_heads, hp)
    if groups in choices:
        return None
    return Violation(f"head_groups={groups} with {heads} query and {kv_heads} KV heads at "
                     f"hp={hp} ({heads // hp} query and {max(kv_heads, hp) // hp} KV heads a rank)",
                     "head groups divide the query heads a rank holds, and divide its KV heads "
                     "or are a multiple of them (each group keeps whole KV heads, or shares one)",
                     f"use head_groups in {choices}")


def rank_of(dp_i: int, cp_i: int, hp_i: int, cp: int, hp: int, placement: str) -> int:
    """Global rank at mesh coordinate ``(dp_i, cp_i, hp_i)`` (LoongTrain §4.4)."""
    if placement == "head_first":
        return (dp_i * cp + cp_i) * hp + hp_i
    return (dp_i * hp + hp_i) * cp + cp_i


def ring_position(cp_rank: int, inner_ring: int) -> tuple[int, int]:
    """``(i, j)``: CP rank ``i·w + j`` is position ``j`` of inner ring ``i``."""
    return divmod(cp_rank, inner_ring)
