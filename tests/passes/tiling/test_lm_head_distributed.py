"""The LM head chunked with the loss under hp=2 x cp=2, under Inductor (issue 22): each rank's
loss is its share (its tokens' sum over the batch's label count), and the ranks' losses and
gradients add up to one process's on the full sequence, float64.

The example Llama through ``loong_compile.NextTokenLoss``; the trust matrix's loss-in-graph
habits (``tests/trust_cases.py``: transformers' own loss with ``labels=``, ``shift_labels=``,
``num_items_in_batch=`` on Llama and on Gemma3 with final-logit softcapping and tied
embeddings, Qwen2 with key padding labelled ``-100``, and a Llama head tied to the
embedding).  One spawn of 4 ranks for all of them.
"""

from __future__ import annotations

import pytest
import torch

from loong_compile.testing import run_distributed
from trust_cases import BATCH, LM_HEAD_CHUNK, LOSS_IN_GRAPH_CASES, SEQ, token_ids
from trust_reference import INDUCTOR_TOLERANCE, reference, relative_error, tolerance
from trust_run import loss_in_graph_step

pytestmark = pytest.mark.multirank  # spawns gloo ranks (pytest -m 'not multirank' leaves it out)

HP, CP = 2, 2
LOCAL_TOKENS = BATCH * SEQ // (HP * CP)


def _own_llama(dtype=torch.float64):
    from llama import Llama, LlamaConfig

    torch.manual_seed(0)
    return Llama(LlamaConfig(vocab_size=64, dim=32, n_layers=1, n_heads=4, n_kv_heads=2,
                             ffn_dim=48)).to(dtype)


def _own_llama_step(hp: int, cp: int):
    import torch.distributed as dist

    import loong_compile as lc

    mesh = lc.init_mesh(hp=hp, cp=cp)
    model, reports = _own_llama(), []
    options = {"hp": hp, "cp": cp, "rank_check_timeout": 60, "lm_head_chunk": LM_HEAD_CHUNK}
    step = torch.compile(lc.NextTokenLoss(model), fullgraph=True,
                         backend=lc.LoongBackend(options, on_report=reports.append))
    batch = lc.shard_batch(token_ids(), token_ids(), mesh)
    loss = step(batch.input_ids, batch.labels, batch.num_labels, position_ids=batch.position_ids)
    loss.backward()
    loss = loss.detach()
    dist.all_reduce(loss)
    grads = {}
    for name, p in model.named_parameters():
        dist.all_reduce(p.grad)
        grads[name] = p.grad
    return loss.item(), grads, reports[-1].summary("lm_head_loss")


def _own_llama_reference():
    import loong_compile as lc

    model, ids = _own_llama(), token_ids()
    labels = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], dim=1)
    loss = lc.next_token_loss(model(ids, position_ids=torch.arange(SEQ).expand(BATCH, -1)), labels,
                              int((labels != -100).sum()))
    loss.backward()
    return loss.item(), {n: p.grad.numpy() for n, p in model.named_parameters()}


def _all_cases(rank: int, world: int) -> dict:
    outcomes = {}
    runs = [("own llama", lambda: _own_llama_step(HP, CP))] + [
        (case.name, lambda case=case: loss_in_graph_step(case, HP, CP, "inductor"))
        for case in LOSS_IN_GRAPH_CASES]
    for name, run in runs:
        torch._dynamo.reset()
        try:
            loss, grads, summary = run()
            outcomes[name] = ("ok", loss, {n: g.numpy() for n, g in grads.items()}, summary) \
                if rank == 0 else ("ok", summary["changed"][0]["chunks"])
        except Exception as exc:  # noqa: BLE001 - reported by the test
            import traceback

            outcomes[name] = ("failed", f"{type(exc).__name__}: {traceback.format_exc()[-2000:]}")
    return outcomes


@pytest.fixture(scope="module")
def outcomes():
    return run_distributed(_all_cases, HP * CP, timeout=2400)


@pytest.mark.slow
@pytest.mark.timeout(2500)
@pytest.mark.parametrize("name", ["own llama"] + [c.name for c in LOSS_IN_GRAPH_CASES])
def test_chunked_loss_under_hp2_cp2_inductor_equals_one_process(outcomes, name):
    for rank, result in enumerate(outcomes):
        assert result[name][0] == "ok", f"rank {rank}: {result[name][1]}"
    _, loss, grads, summary = outcomes[0][name]
    (head,) = summary["changed"]                       # the head was chunked, on every rank
    assert head["tokens"] == LOCAL_TOKENS and head["chunk"] == LM_HEAD_CHUNK
    assert all(r[name][1] == head["chunks"] == LOCAL_TOKENS // LM_HEAD_CHUNK for r in outcomes[1:])
    if name == "own llama":
        want, tol = _own_llama_reference(), INDUCTOR_TOLERANCE
    else:
        case = next(c for c in LOSS_IN_GRAPH_CASES if c.name == name)
        want, tol = reference(case), max(tolerance(case), INDUCTOR_TOLERANCE)
        assert head["softcap"] == (case.arch == "gemma3")
        tied = case.arch == "gemma3" or case.habit == "loss_in_graph_tied"
        assert ("embed_tokens" in head["weight"]) == tied, head["weight"]
    error = relative_error((loss, grads), want)
    assert error <= tol, f"{name}: relative error {error:.1e} (tolerance {tol:.0e})"
