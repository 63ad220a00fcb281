"""passes/scans/gated_delta.py on Dynamo graphs of one rank's share (T = 12 tokens, cp = 2): a call
of transformers' ``torch_chunk_gated_delta_rule`` becomes ``ops.scans.gated_scan.gated_delta_rule``; a
function of the same name that computes something else is run, found not to be the rule, and
left for the token analysis, which refuses it by name."""

import pytest
import torch
from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule as transformers_rule

from graph_helpers import StubMesh, dynamo_graph
from loong_compile import LoongConfig
from loong_compile.errors import LoongTokenMixingError
from loong_compile.ops.scans.gated_scan import gated_delta_rule
from loong_compile.passes.base import PassContext
from loong_compile.passes.safety.token_locality import TokenLocalityPass
from loong_compile.passes.scans.gated_delta import GatedDeltaPass

# transformers' own function: in the subset CI runs on both ends of the transformers range
pytestmark = pytest.mark.compat

B, T, HK, HV, D = 2, 12, 2, 4, 8


def torch_chunk_gated_delta_rule(query, key, value, g, beta, **kwargs):
    """Not the rule: gated linear attention, token by token (the state decays and adds each
    token's k (beta v), without the delta rule's correction).  It reads its inputs in the rule's
    order, so the pass runs it and compares.  (Written out, not a call of transformers' rule:
    since 5.25 that is a module of its own, whose call alone would be the rule.)"""
    q, k = (x.repeat_interleave(HV // HK, dim=2) for x in (query, key))
    v, b, decay = value, beta, g.exp()
    state = q.new_zeros(B, HV, D, D)
    out = []
    for t in range(q.size(1)):
        state = state * decay[:, t, :, None, None] + k[:, t, :, :, None] * (b[:, t, :, None, None] * v[:, t, :, None, :])
        out.append(torch.einsum("bhk,bhkv->bhv", q[:, t], state))
    return torch.stack(out, 1), None


def run_passes(rule):
    def layer(q, k, v, a, b):
        out, _ = rule(q, k, v, g=-torch.nn.functional.softplus(a), beta=b.sigmoid(),
                      use_qk_l2norm_in_kernel=True)
        return out
    gen = torch.Generator().manual_seed(0)
    inputs = [torch.randn(B, T, HK, D, generator=gen), torch.randn(B, T, HK, D, generator=gen),
              torch.randn(B, T, HV, D, generator=gen), torch.randn(B, T, HV, generator=gen),
              torch.randn(B, T, HV, generator=gen)]
    ctx = PassContext(config=LoongConfig(cp=2, allow_graphs_without_attention=True), mesh=StubMesh(cp=2))
    graph = dynamo_graph(layer, *inputs)
    summary = GatedDeltaPass().run(graph, ctx)
    TokenLocalityPass().run(graph, ctx)
    return summary, graph


def test_transformers_rule_becomes_the_op_once_proven():
    summary, graph = run_passes(transformers_rule)
    (call,) = [n for n in graph.graph.nodes if n.target is gated_delta_rule]
    assert call.kwargs["cp"] == 2 and call.args[5] is True          # the l2 norm, found by running
    (changed,) = summary["changed"]
    assert changed["proof_error"] < 1e-5 and changed["l2norm"]
    # 2 runs x B x 4 heads x (8*8 transition + 8*8 state) float32 values to the other rank
    assert changed["bytes_to_each_rank"] == 2 * B * HV * (D * D + D * D) * 4


def test_a_function_of_that_name_that_is_not_the_rule_is_refused():
    with pytest.raises(LoongTokenMixingError, match="torch_chunk_gated_delta_rule .*carries a state"):
        run_passes(torch_chunk_gated_delta_rule)
