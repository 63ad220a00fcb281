"""Tile what is token-local and wider inside than at its edges: each such region (an MLP of any
family) runs a tile of tokens at a time, saving only its input.

Contract
--------
stage:    dynamo, last (after ``token_locality``, which refuses a multi-rank graph that mixes
          tokens outside the exact ops, and ``lm_head_loss``, whose op it leaves alone)
applies:  unless ``tile_tokens=0``
uses:     ``attention_sites``, ``scan_sites``: the exact mixers, never inside a region
matches:  in the top-level graph, the regions ``region_find.py`` defines: the closure of one
          token value (what it computes alone) proven token-local node by node by the token
          analysis (``passes/fx/token_analysis.py``: a mixture of experts' dispatch by its row
          permutation proof), holding values wider than that input, handing out only values no
          wider, its intermediates larger than its input and outputs together.  Found by what
          the nodes compute, not by a module's class or name.
emits:    per region whose tokens take more than one tile (``estimate/tiling.py::region_tile``
          of its intermediates' bytes per token, option ``tile_tokens``), one
          ``torch.ops.loong.tiled_region`` call (``ops/tiling/region.py``) on the region's input
          and the weights it reads, and a ``getitem`` per output; the region's nodes are
          removed.  Under ``hp*cp > 1`` it runs on the rank's tokens, which is exact: each
          token is computed alone.  The weights are the op's inputs, so FSDP2 gathers them once
          for the region (its module hooks, before the call), never per tile.
leaves:   a region whose sizes it cannot cut (a number of tokens where it is no shape) or
          whose tokens fit one tile (reported with why); nodes under autocast or ``no_grad``
          in the graph (counted) and higher-order-op bodies (a checkpointed layer: listed).
reports:  each tiled region (its input, module, source, nodes, outputs, tokens, tile, tile
          count, the bytes its intermediates take at full length: what a layer no longer keeps,
          a tile's share of them, and what the op keeps: its input), and each region left
          whole with why.
"""

from __future__ import annotations

import math
import operator
import os
from typing import Any

import torch
import torch.fx

from loong_compile.estimate.tiling import TILE_BYTES, region_tile, tile_count
from loong_compile.ops.tiling.region import Region, register_region
from loong_compile.passes.base import ATTENTION_SITES, SCAN_SITES, Pass, PassContext, exact_mixers
from loong_compile.passes.fx.emit import copy_source_meta
from loong_compile.passes.fx.module_paths import module_path, normalize_module_path, source_line
from loong_compile.passes.fx.nodes import example_value
from loong_compile.passes.fx.subgraphs import graph_scopes
from loong_compile.passes.fx.token_analysis import TokenAnalysis
from loong_compile.passes.fx.tokens import local_token_count
from loong_compile.passes.tiling.region_find import Closure, Finder, value_bytes
from loong_compile.passes.tiling.region_graph import NotTiled, layouts, region_module

Node = torch.fx.Node


class TokenTilingPass(Pass):
    name, stage = "token_tiling", "dynamo"
    uses = (ATTENTION_SITES, SCAN_SITES)

    def enabled(self, config) -> bool:
        return config.tile_tokens != 0

    def run(self, gm: torch.fx.GraphModule, ctx: PassContext) -> dict[str, Any]:
        setting = ctx.config.tile_tokens
        tokens = local_token_count(gm)
        if not isinstance(tokens, int):
            return {"matched": 0, "changed": [], "not_tiled": [], "tile_setting": setting,
                    "reason": "the graph's token count is not a static number"}
        if setting == "auto" and (total := _graph_bytes(gm)) + tokens <= TILE_BYTES:
            return {"matched": 0, "changed": [], "not_tiled": [], "tile_setting": setting,
                    "reason": f"the graph's values take {total} bytes in all: any region's "
                              f"intermediates fit one tile ({TILE_BYTES} bytes)"}
        mixers = exact_mixers(ctx)
        analysis = TokenAnalysis(tokens, set(ctx.config.token_local_ops), mixers)
        top, *bodies = graph_scopes(gm)
        analysis.scan(top)
        analysis.refuse_unproven()
        finder = Finder(gm.graph, analysis, mixers)
        regions, rejected = finder.regions()
        changed, not_tiled = [], [_describe(c, why) for c, why in rejected]
        for closure in regions:
            try:
                changed.append(_tile(gm.graph, closure, analysis, ctx.config))
            except NotTiled as why:
                not_tiled.append(_describe(closure, str(why)))
        if changed:
            gm.graph.lint()
            gm.recompile()
        return {"matched": len(regions), "changed": changed, "not_tiled": not_tiled,
                "tile_setting": setting,
                "intermediate_bytes": sum(c["intermediate_bytes"] for c in changed),
                # a checkpointed layer's body (transformers' gradient checkpointing) is
                # not searched: its regions run whole (the checkpoint recomputes them anyway)
                "bodies_not_searched": [scope.hop for scope in bodies],
                # nodes autocast casts at or the graph runs without gradients: never in a region
                # (the op runs its region as its own code, outside the graph's autocast)
                "autocast_or_no_grad_nodes": len(finder.quiet)}


def _tile(graph: torch.fx.Graph, closure: Closure, analysis: TokenAnalysis, config) -> dict:
    entry = example_value(closure.entry)
    axis = analysis.axes(closure.entry)[0]
    size, units = entry.shape[axis], math.prod(entry.shape[:axis])
    setting = config.tile_tokens
    if setting != "auto":
        setting = max(1, setting // units)
    tile = region_tile(size, -(-closure.interior_bytes // size), setting)
    if tile >= size:
        raise NotTiled(f"its {size * units} tokens fit one tile (tile_tokens={config.tile_tokens!r})")
    module = region_module(closure, axis, analysis)
    outputs = layouts(module, closure, axis, tile)
    lowering = "inductor" if config.lowering == "inductor" else "eager"
    key = register_region(Region(module, axis, outputs, lowering,
                                 tuple(sorted(config.inductor_options.items()))))
    node = _replace(graph, closure, key, tile)
    return {"node": node.name, "entry": closure.entry.name, "module": _module(closure.nodes),
            "source": source_line(_widest(closure.nodes)), "nodes": len(closure.nodes),
            "outputs": [e.name for e in closure.exits], "axis": axis,
            "tokens": size * units, "tile": tile * units, "tiles": tile_count(size, tile),
            "intermediate_bytes": closure.interior_bytes,
            "tile_bytes": closure.interior_bytes * tile // size,
            "kept_bytes": value_bytes(closure.entry), "region": key,
            "lowering": lowering}


def _replace(graph: torch.fx.Graph, closure: Closure, key: str, tile: int) -> Node:
    """One call of the op in place of the region's nodes, its outputs' ``getitem``s in place of
    the region's exits."""
    inside = set(closure.nodes)
    users = [u for e in closure.exits for u in e.users if u not in inside]
    ready = max([closure.entry, *closure.others])
    if users and min(users) < ready:
        raise NotTiled(f"its outputs are read before all its inputs are ready ({ready.name})")
    op = torch.ops.loong.tiled_region.default
    with graph.inserting_after(ready):
        node = graph.call_function(op, (key, tile, closure.entry, list(closure.others)))
    copy_source_meta(_widest(closure.nodes), node)
    entry = example_value(closure.entry)
    with entry.fake_mode:
        values = op(key, tile, entry, [example_value(o) for o in closure.others])
    node.meta["example_value"] = values
    at = node
    for i, (exit_node, value) in enumerate(zip(closure.exits, values)):
        with graph.inserting_after(at):
            at = graph.call_function(operator.getitem, (node, i))
        copy_source_meta(exit_node, at)
        at.meta["example_value"] = value
        exit_node.replace_all_uses_with(at)
    for old in reversed([*closure.constants, *closure.nodes]):
        if not old.users:
            graph.erase_node(old)
    return node


def _graph_bytes(gm: torch.fx.GraphModule) -> int:
    """Bytes of every value the graph computes (its higher-order-op bodies' are inside their
    calls' values or not tiled): a bound on any region's intermediates."""
    return sum(value_bytes(n) for n in gm.graph.nodes)


def _widest(nodes: list[Node]) -> Node:
    """The region's widest value: where its source line points (an up projection)."""
    return max(nodes, key=value_bytes)


def _module(nodes: list[Node]) -> str:
    """The module path all of the region's nodes share (the MLP, or the layer when the norm
    before it joins)."""
    paths = [normalize_module_path(module_path(n)).split(".") for n in nodes]
    return ".".join(os.path.commonprefix(paths)) if paths else ""


def _describe(closure: Closure, why: str) -> dict[str, Any]:
    return {"entry": closure.entry.name, "module": _module(closure.nodes),
            "source": source_line(_widest(closure.nodes)) if closure.nodes else "",
            "nodes": len(closure.nodes), "reason": why}
