"""passes/scans/causal_conv.py on Dynamo graphs of one rank's share (T = 12 tokens of a sequence
split over cp = 2): the causal convolution transformers writes becomes the exact op; any other
convolution over the tokens is left for the token analysis, which refuses it by name."""

import pytest
import torch
import torch.nn.functional as F

from graph_helpers import StubMesh, dynamo_graph
from loong_compile import LoongConfig
from loong_compile.errors import LoongTokenMixingError
from loong_compile.ops.scans.causal_conv import causal_conv1d
from loong_compile.passes.base import PassContext
from loong_compile.passes.safety.token_locality import TokenLocalityPass
from loong_compile.passes.scans.causal_conv import CausalConvPass

B, C, T, K = 2, 8, 12, 4


def run_passes(fn, *inputs):
    """The conv pass, then the token analysis, on fn's graph: (conv summary, graph)."""
    ctx = PassContext(config=LoongConfig(cp=2, allow_graphs_without_attention=True), mesh=StubMesh(cp=2))
    graph = dynamo_graph(fn, *inputs)
    summary = CausalConvPass().run(graph, ctx)
    TokenLocalityPass().run(graph, ctx)
    return summary, graph


class Mixer(torch.nn.Module):
    """Hidden states (B, T, C) in, the convolution over the tokens written by ``conv``."""

    def __init__(self, conv, weight_shape=(C, 1, K)):
        super().__init__()
        self.conv, self.weight = conv, torch.nn.Parameter(torch.randn(weight_shape))

    def forward(self, hidden):
        return F.silu(self.conv(hidden.transpose(1, 2), self.weight)).transpose(1, 2)


def test_transformers_causal_conv_becomes_the_op():
    # transformers' causal_conv1d_fn: its weight squeezed by the caller, unsqueezed inside
    mixer = Mixer(lambda x, w: F.conv1d(x, w.squeeze(1).unsqueeze(1), None, padding=K - 1,
                                        groups=C)[:, :, :T])
    summary, graph = run_passes(mixer, torch.randn(B, T, C))
    calls = [n for n in graph.graph.nodes if n.target is causal_conv1d]
    assert len(calls) == 1 and not [n for n in graph.graph.nodes if n.target in (F.conv1d, torch.conv1d)]
    assert calls[0].kwargs["group_rank"] is None      # read at run time: one graph for every rank
    (changed,) = summary["changed"]
    # 2 runs (the zigzag's two chunks) x B x C x (K-1) float32 values to the other rank
    assert (changed["channels"], changed["kernel"], changed["bytes_to_each_rank"]) == (C, K, 2 * B * C * 3 * 4)


def test_nn_conv1d_with_bias_and_an_ellipsis_slice_becomes_the_op():
    conv = torch.nn.Conv1d(C, C, K, groups=C, padding=K - 1)
    summary, _ = run_passes(Mixer(lambda x, w: conv(x)[..., :T]), torch.randn(B, T, C))
    assert summary["matched"] == 1


@pytest.mark.parametrize("what,conv,weight_shape", [
    ("not causal", lambda x, w: F.conv1d(x, w, padding=(K - 1) // 2, groups=C), (C, 1, K)),
    ("strided", lambda x, w: F.conv1d(x, w, padding=K - 1, groups=C, stride=2)[:, :, :T], (C, 1, K)),
    ("kept past the tokens", lambda x, w: F.conv1d(x, w, padding=K - 1, groups=C)[:, :, 1:T + 1],
     (C, 1, K)),
    ("not depthwise", lambda x, w: F.conv1d(x, w, padding=K - 1, groups=C // 2)[:, :, :T], (C, 2, K)),
])
def test_any_other_convolution_over_the_tokens_is_refused(what, conv, weight_shape):
    with pytest.raises(LoongTokenMixingError, match="slides over the token axis"):
        run_passes(Mixer(conv, weight_shape), torch.randn(B, T, C))
