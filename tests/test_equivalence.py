"""backend="loong" with no distribution equals backend="inductor": same loss, same gradients."""

import pytest
import torch

import loong_compile  # noqa: F401  (registers "loong")
from llama import Llama, LlamaConfig


def hf_llama(num_kv_heads: int = 2):
    from transformers import LlamaConfig as HFConfig, LlamaForCausalLM

    cfg = HFConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=num_kv_heads,
                   max_position_embeddings=256, attn_implementation="sdpa")
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg)


def example_llama():
    torch.manual_seed(0)
    return Llama(LlamaConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128))


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
    loss, grads = _loss_and_grads(model, "loong", ids)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=0)
    assert grads.keys() == ref_grads.keys()
    for name in grads:
        torch.testing.assert_close(grads[name], ref_grads[name], rtol=1e-5, atol=1e-7, msg=name)
        assert grads[name].abs().sum() > 0, name  # a gradient that vanished is not "equal"
