"""passes/scans/mamba2.py on Dynamo graphs of one rank's share (T = 12 tokens, cp = 2): a call of
transformers' ``mamba2_chunk_scan`` becomes ``ops.scans.gated_scan.mamba2_scan`` with the dt rule it
was found to apply; a function of the same name that computes something else is run, found not
to be the scan, and left for the token analysis, which refuses it by name."""

import math

import pytest
import torch
from transformers.models.falcon_h1.modeling_falcon_h1 import mamba2_chunk_scan as transformers_scan

from graph_helpers import StubMesh, dynamo_graph
from loong_compile import LoongConfig
from loong_compile.errors import LoongTokenMixingError
from loong_compile.ops.scans.gated_scan import mamba2_scan
from loong_compile.passes.base import PassContext
from loong_compile.passes.safety.token_locality import TokenLocalityPass
from loong_compile.passes.scans.mamba2 import Mamba2Pass

# transformers' own function: in the subset CI runs on both ends of the transformers range
pytestmark = pytest.mark.compat

B, T, H, P, G, N = 2, 12, 4, 8, 2, 6


def mamba2_chunk_scan(x, dt, A, B, C, chunk_size, **kwargs):
    """Not the scan: the decay between chunks dropped (each chunk starts from a zero state)."""
    return torch.cat([transformers_scan(x[:, i:i + 4], dt[:, i:i + 4], A, B[:, i:i + 4], C[:, i:i + 4],
                                        chunk_size=4, **kwargs) for i in range(0, x.size(1), 4)], 1)


def run_passes(scan, softplus: bool, limit: tuple[float, float]):
    def mixer(x, dt, A, b, c, D, dt_bias):
        return scan(x, dt, A, b, c, chunk_size=16, D=D, dt_bias=dt_bias, dt_softplus=softplus,
                    dt_limit=limit)
    gen = torch.Generator().manual_seed(0)
    inputs = [torch.randn(B, T, H, P, generator=gen), torch.randn(B, T, H, generator=gen),
              -torch.rand(H, generator=gen), torch.randn(B, T, G, N, generator=gen),
              torch.randn(B, T, G, N, generator=gen), torch.randn(H, generator=gen),
              torch.randn(H, generator=gen)]
    ctx = PassContext(config=LoongConfig(cp=2, allow_graphs_without_attention=True), mesh=StubMesh(cp=2))
    graph = dynamo_graph(mixer, *inputs)
    summary = Mamba2Pass().run(graph, ctx)
    TokenLocalityPass().run(graph, ctx)
    return summary, graph


@pytest.mark.parametrize("softplus,limit", [(True, (0.0, math.inf)), (False, (0.001, 0.1))])
def test_transformers_scan_becomes_the_op_once_proven(softplus, limit):
    summary, graph = run_passes(transformers_scan, softplus, limit)
    (call,) = [n for n in graph.graph.nodes if n.target is mamba2_scan]
    assert call.kwargs["cp"] == 2
    (changed,) = summary["changed"]
    assert changed["dt"] == {"softplus": softplus, "clamp": list(limit)}      # found by running it
    assert changed["proof_error"] < 1e-5 and (changed["groups"], changed["state"]) == (G, N)
    # 2 runs x B x 4 heads x (1 decay + 6*8 state) float32 values to the other rank
    assert changed["bytes_to_each_rank"] == 2 * B * H * (1 + N * P) * 4


def test_a_function_of_that_name_that_is_not_the_scan_is_refused():
    with pytest.raises(LoongTokenMixingError, match="mamba2_chunk_scan .*carries a state"):
        run_passes(mamba2_chunk_scan, True, (0.0, math.inf))
