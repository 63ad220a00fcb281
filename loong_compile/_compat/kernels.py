"""PyTorch's flash-attention kernels (ops/attention/kernels.py): the only aten ops that return the
log-sum-exp that ring attention merges on; and the custom-op tags of ops/.  Checked: torch 2.13
(the CPU kernel takes float64/float32/bfloat16 and fewer KV heads than Q heads)."""

from __future__ import annotations

import contextlib
import inspect

import torch


def sdpa_flash_cpu(q, k, v, is_causal: bool, scale: float, attn_mask=None):
    """``(out, lse)`` of ``aten._scaled_dot_product_flash_attention_for_cpu`` (no dropout);
    ``attn_mask`` is additive, of q's dtype."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, is_causal, attn_mask=attn_mask, scale=scale)


def sdpa_flash_cpu_backward(dout, q, k, v, out, lse, is_causal: bool, scale: float,
                            attn_mask=None):
    """``(dq, dk, dv)`` of the CPU flash kernel, given the final ``out`` and ``lse``."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout, q, k, v, out, lse, 0.0, is_causal, attn_mask=attn_mask, scale=scale)


def sdpa_flash_cuda(q, k, v, is_causal: bool, scale: float):
    """``(out, lse)`` of ``aten._scaled_dot_product_flash_attention`` (CUDA, fp16/bf16)."""
    out, lse, *_ = torch.ops.aten._scaled_dot_product_flash_attention(
        q, k, v, 0.0, is_causal, False, scale=scale)
    return out, lse


def sdpa_flash_cuda_backward(dout, q, k, v, out, lse, is_causal: bool, scale: float):
    """``(dq, dk, dv)`` of the CUDA flash kernel.  Without dropout the philox state is
    unused; ``None`` sequence offsets mean dense (not nested) inputs."""
    seed = torch.zeros(2, dtype=torch.uint64, device=q.device)
    offset = torch.zeros((), dtype=torch.uint64, device=q.device)
    return torch.ops.aten._scaled_dot_product_flash_attention_backward(
        dout, q, k, v, out, lse, None, None, q.size(2), k.size(2), 0.0, is_causal, seed, offset,
        scale=scale)


def cudagraph_unsafe_tags() -> tuple:
    """``(torch.Tag.cudagraph_unsafe,)``, or ``()`` on a torch without the tag.

    Ops that communicate or copy to the host carry it, so Inductor's CUDA graphs
    split around them instead of capturing them.  Checked: torch 2.13 has the tag.
    """
    tag = getattr(torch.Tag, "cudagraph_unsafe", None)
    return () if tag is None else (tag,)


@contextlib.contextmanager
def autograd_in_op_body():
    """Autograd recording inside a custom op's body, where the dispatcher has turned it off:
    flex_attention's backward is only reachable through autograd (ops/attention/flex.py).
    With ``steady_dispatch``'s state besides."""
    keys = torch._C.DispatchKey
    exclude = torch._C._dispatch_tls_local_exclude_set()
    for key in (keys.AutogradFunctionality, keys.AutogradOther, keys.AutogradNestedTensor,
                keys.ADInplaceOrView):
        exclude = exclude.remove(key)
    with torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), exclude), \
            torch.enable_grad():
        yield


@contextlib.contextmanager
def steady_dispatch():
    """One thread-local dispatch state for a ``torch.compile``d function called in a custom
    op's body, whichever path reached the op.  Dynamo guards each input tensor's dispatch keys
    as that state shows them; the first run of a compiled graph reaches the op with
    ``ADInplaceOrView`` excluded and every later run with it included, so a token-tiled region
    compiled once more in the second step (its compile's memory in that step's peak).  The
    private APIs of ``autograd_in_op_body``; checked against torch 2.11, 2.13 and 2.15."""
    exclude = torch._C._dispatch_tls_local_exclude_set().remove(torch._C.DispatchKey.ADInplaceOrView)
    with torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), exclude):
        yield


def create_block_mask_fused(mask_mod, batch, q_len: int, kv_len: int, device: torch.device):
    """flex's ``create_block_mask``; on CUDA compiled (its private ``_compile``), so the mask is
    reduced to 128 x 128 tiles as it is evaluated instead of materialised first."""
    from torch.nn.attention.flex_attention import create_block_mask

    kwargs = {}
    if device.type == "cuda" and "_compile" in inspect.signature(create_block_mask).parameters:
        kwargs["_compile"] = True
    return create_block_mask(mask_mod, batch, None, q_len, kv_len, device=device, **kwargs)
