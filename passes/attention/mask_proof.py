"""Prove what an attention mask built inside the graph means: documents, padding, a window.

transformers builds the ``attn_mask`` it hands to ``F.scaled_dot_product_attention`` from graph
inputs only: the position ids (a new packed document wherever a position is not the previous
one plus one, ``find_packed_sequence_indices``), the tokenizer's 2-D ``attention_mask``
(padding), the config's sliding window and aranges of the (local) length.  Under hp*cp > 1 that
mask covers only this rank's tokens, so the attention pass must replace it with the same
structure over the global sequence; to do so it must know the structure.

It does not trust names or op patterns for that.  It takes the mask's ancestors (the subgraph
that computes it, followed into the callers of higher-order-op bodies), reads each graph input
of that subgraph in a role, the position ids or the attention mask (everything else a constant
or made from constants), and runs it at compile time, on real tensors, on a designed set of
probe inputs of the local length ``L`` (plain and offset positions, packed documents with
boundaries at varied places including one-token documents, random positions; with an attention
mask: left, right and random padding, real tokens marked by varied nonzero values).  Each result
is compared with every candidate

    query i sees key j  iff  doc[i] == doc[j] >= 0  and (causal) j <= i  and (window) i - j < W

where ``doc`` counts documents from the positions (or is 0 everywhere) and is -1 on padded keys
(or ignores the attention mask).  Only the rows of real query tokens are compared: a padded
query's output never reaches real tokens (nobody attends to it), and 2D-Attention gives it zeros.
Exactly one candidate must match every probe, or the mask is refused (``MaskNotProven``, which
the attention pass turns into its named error, with what the mask did instead).

Which input is in which role is proven too, never read from a name (``input_roles.Prover``
tries the readings of a mask's inputs, ``MaskSubgraph.prove`` runs one).

A window ``W >= L`` cannot be seen at length ``L``: the pass takes it from the module.
The subgraph costs what transformers pays per forward to build its mask (``B x L x L`` booleans),
once per probe batch.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any

import torch
import torch.fx

from loong_compile._compat.aot import real_tensors
from loong_compile.passes.fx.walks import ancestors
from loong_compile.passes.fx.subgraphs import hop_name

POSITIONS, PADDING = "position_ids", "attention_mask"


class MaskNotProven(Exception):
    """Why a mask is not provably document / padding / window structure (a sentence)."""


@dataclasses.dataclass(frozen=True)
class MaskMeaning:
    causal: bool
    documents: bool       # documents from the position ids
    padding: bool         # keys where the attention mask is 0 are seen by nobody
    window: int | None    # a window seen within the local length (None: none shorter than it)
    chunk: int | None = None  # chunked attention (Llama 4): blocks of this many tokens, by
    # position with documents (a document's own blocks), by index without
    probes: tuple[str, ...] = dataclasses.field(default=(), compare=False)  # the evidence

    def reads(self, role: str) -> bool:
        """Whether the mask depends on the input in ``role``."""
        return self.documents if role == POSITIONS else self.padding

    def describe(self) -> str:
        parts = ["causal" if self.causal else "bidirectional"]
        if self.documents:
            parts.append("documents from position_ids")
        if self.padding:
            parts.append("key padding from attention_mask")
        if self.window is not None:
            parts.append(f"window {self.window}")
        if self.chunk is not None:
            parts.append(f"chunks of {self.chunk} tokens")
        return ", ".join(parts)


@dataclasses.dataclass(frozen=True)
class Probe:
    name: str
    positions: torch.Tensor           # (L,)
    padding: torch.Tensor | None      # (L,) bool, True = real token; None: no attention mask


def choose(results: list[tuple[Probe, torch.Tensor]], reads_padding: bool) -> MaskMeaning:
    """The one candidate equal to every probe's mask (``(L, L)`` booleans), else MaskNotProven."""
    plain = results[0][1]  # the first probe: positions 0..L-1, no padding
    length = plain.shape[-1]
    seen_last = int(plain[-1].sum())
    windows = [None] + ([seen_last] if 0 < seen_last < length else [])
    chunks = [None] + _chunk_sizes(plain)
    matching = []
    for causal, documents, padding, window, chunk in itertools.product(
            (True, False), (False, True), (False, True) if reads_padding else (False,), windows,
            chunks):
        if (window is not None or chunk is not None) and not causal or window and chunk:
            continue
        meaning = MaskMeaning(causal, documents, padding, window, chunk)
        if all(_agrees(got, candidate_mask(p, meaning), p) for p, got in results):
            matching.append(meaning)
    names = tuple(p.name for p, _ in results)
    if len(matching) == 1:
        return dataclasses.replace(matching[0], probes=names)
    if matching:
        raise MaskNotProven(f"the probes ({', '.join(names)}) fit several structures "
                            f"({'; '.join(m.describe() for m in matching)})")
    raise MaskNotProven(_mismatch(results, windows))


def candidate_mask(probe: Probe, meaning: MaskMeaning) -> torch.Tensor:
    """``(L, L)`` booleans: which keys each query sees under ``meaning`` (the API13 rule)."""
    positions = probe.positions
    length = positions.shape[0]
    docs = document_ids(positions) if meaning.documents else torch.zeros_like(positions)
    if meaning.padding and probe.padding is not None:
        docs = docs.masked_fill(~probe.padding, -1)
    i = torch.arange(length)[:, None]
    j = torch.arange(length)[None, :]
    seen = (docs[:, None] == docs[None, :]) & (docs[None, :] >= 0)
    if meaning.causal:
        seen &= j <= i
    if meaning.window is not None:
        seen &= i - j < meaning.window
    if meaning.chunk is not None:
        # transformers' chunked_overlay counts by token index, or by position where it reads
        # documents from the positions (remap_positions_for_packed_sequence)
        block = (positions if meaning.documents else torch.arange(length)) // meaning.chunk
        seen &= block[:, None] == block[None, :]
    return seen


def _chunk_sizes(plain: torch.Tensor) -> list[int]:
    """The chunk size the first probe's mask shows (one candidate at most): the first query that
    does not see the key before it, when the whole mask is causal attention in blocks of that
    many tokens, two at least (one would be every token alone: what documents of one token
    give, a reading of the inputs the other probes must decide)."""
    length = plain.shape[-1]
    breaks = [i for i in range(1, length) if plain[i, i] and not plain[i, i - 1]]
    if not breaks or breaks[0] < 2:
        return []
    i = torch.arange(length)[:, None]
    j = torch.arange(length)[None, :]
    chunked = (j <= i) & (i // breaks[0] == j // breaks[0])
    return breaks[:1] if torch.equal(plain, chunked) else []


def document_ids(positions: torch.Tensor) -> torch.Tensor:
    """A new document wherever a position is not the previous one plus one (transformers')."""
    starts = torch.ones_like(positions, dtype=torch.bool)
    starts[1:] = positions[1:] != positions[:-1] + 1
    return starts.long().cumsum(0) - 1


def probe_inputs(length: int, with_padding: bool, seed: int = 0) -> list[Probe]:
    """The designed probes of ``length`` tokens; the first is plain positions without padding."""
    g = torch.Generator().manual_seed(seed)
    arange = torch.arange(length)
    sizes = itertools.cycle((1, 2, 3, 1, 5, 4))
    packed, filled = [], 0
    while filled < length:
        size = min(next(sizes), length - filled)
        packed.append(torch.arange(size))
        filled += size
    half = length // 2
    positions = {
        "plain": arange,
        "offset": arange + 7,  # a rank in the middle of a document
        "packed": torch.cat(packed),  # one-token documents, boundaries at varied places
        "halves": torch.cat([torch.arange(half), torch.arange(length - half)]),
        "last_alone": torch.cat([torch.arange(length - 1), torch.zeros(1, dtype=torch.long)]),
        "random": torch.randint(0, max(length, 2), (length,), generator=g),
    }
    probes = [Probe(name, p, None) for name, p in positions.items()]
    if not with_padding:
        return probes
    third = max(length // 3, 1)
    real = torch.ones(length, dtype=torch.bool)
    paddings = {
        "left_padding": torch.cat([~real[:third], real[third:]]),
        "right_padding": torch.cat([real[:length - third], ~real[length - third:]]),
        "random_padding": torch.rand(length, generator=g) > 0.3,
    }
    probes = [Probe(p.name, p.positions, real) for p in probes]
    for (pname, pos), (mname, pad) in itertools.product(
            (("plain", arange), ("packed", positions["packed"]), ("random", positions["random"])),
            paddings.items()):
        probes.append(Probe(f"{pname}+{mname}", pos, pad))
    return probes


def _marked(padding: torch.Tensor) -> torch.Tensor:
    """An attention mask marking ``padding``'s real tokens by varied nonzero values (1, 2, 3, 4):
    transformers and ``sequence_document_ids`` read any nonzero value as a real token, and a
    mask that reads only 1 as one is not that structure.  The values count up in runs of
    uneven length (2, 3, 1, 4): read as positions they make documents of uneven length, which
    look like no window and no chunk."""
    runs = itertools.cycle((2, 3, 1, 4))
    marks: list[int] = []
    while len(marks) < padding.shape[0]:
        marks += range(1, next(runs) + 1)
    return padding.long() * torch.tensor(marks[:padding.shape[0]])


def _agrees(got: torch.Tensor, want: torch.Tensor, probe: Probe) -> bool:
    rows = probe.padding if probe.padding is not None else slice(None)
    return torch.equal(got[rows], want[rows])


def _mismatch(results: list[tuple[Probe, torch.Tensor]], windows: list) -> str:
    """What the mask did that no candidate does: its first differing row against the candidate
    closest to it (fewest differing probes)."""
    def misses(meaning):
        return [(p, got) for p, got in results if not _agrees(got, candidate_mask(p, meaning), p)]

    closest = min((MaskMeaning(c, d, pad, w) for c, d, pad, w in itertools.product(
        (True, False), (False, True), (False, True), windows) if w is None or c),
        key=lambda m: len(misses(m)))
    probe, got = misses(closest)[0]
    want = candidate_mask(probe, closest)
    rows = torch.nonzero((got != want).any(-1) & (probe.padding if probe.padding is not None
                                                  else torch.ones_like(got[:, 0])))
    row = int(rows[0])
    return (f"it is no document/padding/window structure of position_ids and attention_mask: on "
            f"the probe {probe.name!r} query {row} sees keys {_keys(got[row])} where the closest "
            f"structure ({closest.describe()}) gives {_keys(want[row])}")


def _keys(row: torch.Tensor) -> str:
    keys = torch.nonzero(row).flatten().tolist()
    return str(keys) if len(keys) <= 8 else f"{keys[:8]}... ({len(keys)} keys)"


def mask_length(mask: torch.fx.Node) -> int:
    value = mask.meta.get("example_value")
    if not isinstance(value, torch.Tensor) or value.dim() < 2:
        raise MaskNotProven("its shape is unknown")
    q, k = value.shape[-2:]
    if not (isinstance(q, int) and isinstance(k, int)):
        raise MaskNotProven(f"its shape {tuple(value.shape)} is dynamic")
    if q != k:
        raise MaskNotProven(f"it is {q} queries x {k} keys (a cache or a prefix), not square")
    if value.dtype != torch.bool:
        raise MaskNotProven(f"it is an additive {value.dtype} mask; only boolean masks are "
                            "proven")
    return q


class MaskSubgraph:
    """The nodes that compute a mask, run as a function of the probe inputs.

    ``outer``: each inline higher-order-op body's placeholder -> the caller's value."""

    def __init__(self, mask: torch.fx.Node, outer: dict):
        self.mask, self.outer = mask, outer
        self.inputs: list[torch.fx.Node] = []  # the graph inputs it reads
        self._check(mask)
        self.length = mask_length(mask)
        value = mask.meta["example_value"]
        self.batch = value.shape[0] if value.dim() == 4 else 1  # rows: 1 where it broadcasts

    def _check(self, node: Any) -> None:
        """Find the graph inputs the mask reads; refuse an op whose effect hides elsewhere."""
        for n in ancestors([node], inputs=self._inputs_of):
            if n.op == "placeholder":
                if n not in self.outer:
                    self.inputs.append(n)
            elif n.op == "call_module" or hop_name(n) is not None \
                    or "functorch" in (getattr(n.target, "__module__", None) or ""):
                raise MaskNotProven(f"it is built by {n.name} ({n.target}), which the backend "
                                    "does not evaluate on probes")

    def _inputs_of(self, n: torch.fx.Node) -> list:
        """A node's inputs, a body's placeholder standing for the outer node passed to it."""
        if n.op == "placeholder":
            return [self.outer[n]] if n in self.outer else []
        return n.all_input_nodes

    def prove(self, roles: dict[torch.fx.Node, str]) -> MaskMeaning:
        """The meaning of the mask with each input of ``roles`` (every input it reads ->
        ``POSITIONS`` / ``PADDING``) fed its role's probes."""
        # probes per run: one per row of the inputs (a one-row input: one probe per run)
        rows = min([n.meta["example_value"].shape[0] for n in roles] or [1])
        probes = probe_inputs(self.length, PADDING in roles.values())
        results: list[tuple[Probe, torch.Tensor]] = []
        for start in range(0, len(probes), rows):
            results += self._evaluate(probes[start:start + rows], roles)
        return choose(results, PADDING in roles.values())

    def _evaluate(self, chunk: list[Probe],
                  roles: dict[torch.fx.Node, str]) -> list[tuple[Probe, torch.Tensor]]:
        """``(probe, (L, L) mask)`` for each row of the mask, row ``b`` fed ``chunk[b % n]``."""
        env: dict[torch.fx.Node, Any] = {}
        for node, role in roles.items():
            value = node.meta["example_value"]
            rows = [chunk[b % len(chunk)] for b in range(value.shape[0])]
            stacked = torch.stack([p.positions if role == POSITIONS else _marked(p.padding)
                                   for p in rows])
            env[node] = stacked.to(device=value.device, dtype=value.dtype)
        with real_tensors(), torch.no_grad():
            mask = self._run(self.mask, env)
        if mask.dim() > 4 or tuple(mask.shape[-2:]) != (self.length, self.length):
            raise MaskNotProven(f"it has shape {tuple(mask.shape)}")
        mask = mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape)).cpu()
        if not (mask == mask[:, :1]).all():
            raise MaskNotProven("it differs between heads")
        if mask.shape[0] < len(chunk):
            raise MaskNotProven(f"it has {mask.shape[0]} row(s) for inputs of {len(chunk)}")
        return [(chunk[b % len(chunk)], mask[b, 0]) for b in range(mask.shape[0])]

    def _run(self, node: torch.fx.Node, env: dict) -> Any:
        todo = [node]
        while todo:  # depth first, inputs before users
            n = todo[-1]
            if n in env:
                todo.pop()
                continue
            inputs = self._inputs_of(n)
            pending = [a for a in inputs if a not in env]
            if pending:
                todo.extend(pending)
                continue
            todo.pop()
            env[n] = self._value(n, env)
        return env[node]

    def _value(self, n: torch.fx.Node, env: dict) -> Any:
        if n.op == "placeholder":
            return env[self.outer[n]]
        args, kwargs = torch.fx.node.map_arg((n.args, n.kwargs), lambda a: env[a])
        if n.op == "get_attr":
            value: Any = n.graph.owning_module
            for part in n.target.split("."):
                value = getattr(value, part)
            return value
        if n.op == "call_method":
            return getattr(args[0], n.target)(*args[1:], **kwargs)
        return n.target(*args, **kwargs)
