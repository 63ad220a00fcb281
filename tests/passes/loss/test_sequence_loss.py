"""passes/loss/sequence_loss.py on Dynamo graphs: transformers' label shift and mean become the
sequence's; other pads and losses are left to ``token_locality``.

The graphs stand for one rank's share (T = 12 tokens) of a sequence split over cp = 2 ranks;
the rewritten graphs are only inspected (their values on ranks: the trust matrix's "labels" row).
"""

import torch
import torch.nn.functional as F

from graph_helpers import StubMesh, dynamo_graph
from loong_compile import LoongConfig
from loong_compile.ops.sequence import next_token_labels, sequence_label_count
from loong_compile.passes.base import PassContext
from loong_compile.passes.loss.sequence_loss import LABELS_SHIFTED, SequenceLossPass

B, T, V = 2, 12, 16


def run(fn, *inputs):
    ctx = PassContext(config=LoongConfig(cp=2), mesh=StubMesh(cp=2))
    graph = dynamo_graph(fn, *inputs)
    return graph, SequenceLossPass().run(graph, ctx), ctx.state


def targets(graph):
    return [n.target for n in graph.graph.nodes if n.op == "call_function"]


def for_causal_lm_loss(logits, labels):
    """transformers' ForCausalLMLoss without num_items_in_batch."""
    labels = F.pad(labels, (0, 1), value=-100)
    shift = labels[..., 1:].contiguous()
    return F.cross_entropy(logits.float().view(-1, V), shift.view(-1), ignore_index=-100)


def test_the_shift_becomes_the_exchange_and_the_mean_the_sequence_count():
    graph, summary, state = run(for_causal_lm_loss, torch.randn(B, T, V), torch.randint(0, V, (B, T)))
    found = targets(graph)
    assert next_token_labels in found and sequence_label_count in found
    assert F.pad not in found
    (loss,) = [n for n in graph.graph.nodes if n.target is F.cross_entropy]
    assert loss.kwargs["reduction"] == "sum"
    assert [s["fill"] for s in summary["label_shifts"]] == [-100]
    assert state[LABELS_SHIFTED] is True and summary["changed"] == 2


def test_a_sum_over_the_batch_count_keeps_its_divisor():
    def with_count(logits, labels, n):  # num_items_in_batch given: a sum, not a mean
        shift = F.pad(labels, (0, 1), value=-100)[..., 1:]
        return F.cross_entropy(logits.view(-1, V), shift.reshape(-1), reduction="sum") / n

    graph, summary, _ = run(with_count, torch.randn(B, T, V), torch.randint(0, V, (B, T)),
                            torch.tensor(20))
    assert sequence_label_count not in targets(graph) and len(summary["label_shifts"]) == 1


def test_pads_that_are_not_a_label_shift_are_left():
    def others(x, labels):
        before = F.pad(labels, (1, 0), value=-100)[..., :-1]        # a shift the other way
        states = F.pad(x, (0, 0, 0, 1))[:, 1:]                      # hidden states, not labels
        kept = F.pad(labels, (0, 1), value=-100)
        return before.sum() + states.sum() + kept[..., 1:].sum() + kept.sum()  # pad read twice

    graph, summary, state = run(others, torch.randn(B, T, 4), torch.randint(0, V, (B, T)))
    assert next_token_labels not in targets(graph)
    assert summary["label_shifts"] == [] and state[LABELS_SHIFTED] is False
