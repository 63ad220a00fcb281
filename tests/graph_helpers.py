"""Helpers of the passes' graph tests in one process: the graph Dynamo captures for a function,
and stand-ins for the mesh a pass reads (its sizes, group names and the constant arguments it
emits; nothing runs a collective)."""

from __future__ import annotations

import torch


class FakeMesh:
    """What the attention pass reads of a mesh: the constant arguments of attention_2d."""

    def attention_kwargs(self):
        return {"hp": 2, "cp": 2, "inner_ring": 1, "hp_group": "g_hp", "kv_inner_group": "",
                "kv_outer_group": "g_out", "dkv_inner_group": "", "dkv_outer_group": "g_dout"}

    def document_kwargs(self):
        return {"hp": 2, "cp": 2, "sp_group": "g_sp", "hp_group": "g_hp", "cp_group": "g_dout"}


class StubMesh:
    """What the dynamo passes read of a mesh (sizes and group names), for graph tests in one
    process: the graphs stand for a rank of ``hp * cp``; nothing runs a collective."""

    def __init__(self, hp: int = 1, cp: int = 2):
        self.hp, self.cp, self.sp = hp, cp, hp * cp
        self.group_names = {"sp": "sp", "hp": "hp", "dkv_outer": "cp"}

    def document_kwargs(self) -> dict:
        return {"hp": self.hp, "cp": self.cp, "sp_group": "sp", "hp_group": "hp",
                "cp_group": "cp"}

    def scan_kwargs(self, heads_split: bool = False) -> dict:
        places = [(c, h) for c in range(self.cp) for h in range(self.hp)]
        return {"hp": self.hp, "cp": self.cp, "places": places, "group_rank": 0, "scan_group": "sp"}


def dynamo_graph(fn, *inputs, **kw_inputs):
    """The FX graph Dynamo captures for fn (with its fake-tensor metadata, and each input's
    source, which Dynamo drops once the compile is over)."""
    graphs = []

    def capture(gm, example_inputs):
        graphs.append((gm, {n: n.meta["grapharg"] for n in gm.graph.find_nodes(op="placeholder")
                            if "grapharg" in n.meta}))
        return gm.forward

    torch.compile(fn, backend=capture, fullgraph=True)(*inputs, **kw_inputs)
    ((gm, sources),) = graphs
    for node, grapharg in sources.items():
        node.meta["grapharg"] = grapharg
    return gm
