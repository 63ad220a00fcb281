"""passes/attention/made_positions.py on Dynamo graphs: an ``arange`` over the rank's tokens read
as positions (RoPE's angle, a position embedding) becomes the layout's positions; one compared
with itself (a mask) or read otherwise is left to ``token_locality``, which refuses it.

The graphs stand for one rank's share (T = 12 tokens) of a sequence split over cp = 2 ranks.
"""

import torch
import torch.nn.functional as F

from graph_helpers import StubMesh, dynamo_graph
from loong_compile import LoongConfig
from loong_compile.ops.sequence import layout_positions
from loong_compile.passes.attention.made_positions import MADE_POSITIONS, MadePositionsPass
from loong_compile.passes.base import PassContext

B, T, D = 2, 12, 8


def run(fn, *inputs):
    ctx = PassContext(config=LoongConfig(cp=2), mesh=StubMesh(cp=2))
    graph = dynamo_graph(fn, *inputs)
    return graph, MadePositionsPass().run(graph, ctx), ctx.state


def made(graph) -> bool:
    return any(n.target is layout_positions for n in graph.graph.nodes)


class Rope(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("inv_freq", torch.rand(D // 2))

    def forward(self, x):
        pos = torch.arange(x.shape[1])[None, :]
        angle = (pos[..., None].float() * self.inv_freq).repeat(1, 1, 2)
        return x * angle.cos() + x * angle.sin()


def test_positions_rope_reads_become_the_layouts():
    graph, summary, state = run(Rope(), torch.randn(B, T, D))
    assert made(graph) and summary["changed"][0]["read_as"] == "RoPE's angle"
    assert state[MADE_POSITIONS] == {"inputs": [0]}


def test_positions_a_position_embedding_looks_up_become_the_layouts():
    table = torch.nn.Embedding(64, D)

    def learned(x):
        return x + table(torch.arange(x.shape[1]))

    graph, summary, _ = run(learned, torch.randn(B, T, D))
    assert made(graph) and "lookup" in summary["changed"][0]["read_as"]


def test_a_mask_of_the_local_numbers_and_an_unread_arange_are_left():
    inv_freq = torch.rand(D)

    def mask_and_rope(x):
        pos = torch.arange(x.shape[1])
        causal = pos[:, None] >= pos[None, :]          # T x T: pairs the rank's tokens only
        return (x * (pos[None, :, None] * inv_freq).cos()).sum() + causal.sum()

    graph, summary, state = run(mask_and_rope, torch.randn(B, T, D))
    assert not made(graph) and "pairs the numbers" in summary["left"][0]["reason"]
    assert state[MADE_POSITIONS] == {}

    graph, summary, _ = run(lambda x: x + torch.arange(x.shape[1])[None, :, None],
                            torch.randn(B, T, D))
    assert not made(graph) and "nothing reads it as positions" in summary["left"][0]["reason"]


def test_positions_made_into_numbers_become_the_layouts():
    def temperature(x):  # Llama 4's NoPE layers scale q by a function of the token's position
        pos = torch.arange(x.shape[1])
        scale = torch.log1p(torch.floor((pos.float() + 1.0) / 4.0)) * 0.1 + 1.0
        return x * scale[None, :, None]

    graph, summary, _ = run(temperature, torch.randn(B, T, D))
    assert made(graph) and "float cast" in summary["changed"][0]["read_as"]
