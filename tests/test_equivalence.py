"""backend="loong" with no distribution equals backend="inductor": same loss, same gradients."""

import pytest
import torch

import loong_compile  # noqa: F401  (registers "loong")
from helpers import assert_same_loss_and_grads, example_llama, hf_llama


def _loss_and_grads(model, backend, ids, options=None):
    torch._dynamo.reset()
    model.zero_grad(set_to_none=True)
    compiled = torch.compile(model, backend=backend, fullgraph=True, options=options)
    out = compiled(ids)
    logits = out if isinstance(out, torch.Tensor) else out.logits
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.compat
@pytest.mark.slow
@pytest.mark.parametrize("make_model", [example_llama, hf_llama], ids=["example", "hf"])
def test_loong_equals_inductor(make_model):
    model = make_model()
    ids = torch.randint(0, 256, (2, 48), generator=torch.Generator().manual_seed(1))
    ref_loss, ref_grads = _loss_and_grads(model, "inductor", ids)
    assert_same_loss_and_grads(_loss_and_grads(model, "loong", ids), (ref_loss, ref_grads))
