"""The CUDA kernels' contracts, checked on CPU with stand-ins that behave as the kernels do.

* Layout: flash-attn's ``mha_bwd`` and PyTorch's CUDA flash backward read the
  LSE, the output and its gradient as contiguous memory from their data
  pointers.  ``strict_flash_backward`` is the CPU kernel fed exactly that
  (tests/stand_ins/kernel_layout.py), put in the place of the kernels.
* Head dims: the CUDA flash kernels take one head dim for q, k and v, a multiple
  of 8 (MLA's V, narrower than Q/K, is padded to it).
* flash-attn 2.7-2.8 registers ``torch.ops.flash_attn.*`` (the stand-in package
  in tests/stand_ins/flash_attn mirrors its interface and op namespace).
* Ops that communicate or move data to the host are tagged ``cudagraph_unsafe``.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from loong_compile._compat.kernels import sdpa_flash_cpu, sdpa_flash_cpu_backward
from loong_compile.parallel.tokens import mesh_token_indices, sequence_divisor
from loong_compile.errors import LoongShapeError
from loong_compile.parallel.mesh import init_mesh
from loong_compile.ops import attention_2d
from loong_compile.ops.attention import kernels
from loong_compile.testing import run_distributed

pytestmark = pytest.mark.multirank  # spawns gloo ranks (pytest -m 'not multirank' leaves it out)

TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-5}


def require_one_head_dim_multiple_of_8(*tensors) -> None:
    sizes = {t.size(-1) for t in tensors}
    if len(sizes) != 1 or next(iter(sizes)) % 8:
        raise RuntimeError(f"head sizes {sorted(sizes)}: one head size, a multiple of 8 "
                           "(CUDA flash)")


def strict_flash_forward(q, k, v, is_causal, scale):
    """The CPU kernel's results in the CUDA kernel's layouts (the CPU LSE is (B, S, H) in
    memory, the CUDA kernels' is (B, H, S))."""
    require_one_head_dim_multiple_of_8(q, k, v)
    return tuple(t.contiguous() for t in sdpa_flash_cpu(q, k, v, is_causal, scale))


def strict_flash_backward(dout, q, k, v, out, lse, is_causal, scale):
    """The CPU kernel given what the CUDA kernels read: lse/out/dout as raw contiguous memory."""
    from kernel_layout import kernel_reads

    require_one_head_dim_multiple_of_8(dout, q, k, v, out)
    return sdpa_flash_cpu_backward(kernel_reads(dout), q, k, v, kernel_reads(out),
                                   kernel_reads(lse), is_causal, scale)


def reference(q, k, v, dout, is_causal, scale=None):
    """One process, float64: SDPA's out and (dq, dk, dv)."""
    q, k, v = (t.detach().double().requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, scale=scale,
                                         enable_gqa=True)
    return out.detach(), *torch.autograd.grad(out, (q, k, v), dout.double())


def relative_errors(got, want) -> list[float]:
    return [((g.double() - w).abs().max() / w.abs().max()).item() for g, w in zip(got, want)]


def random_qkv_dout(heads, kv_heads, seq, head_dim, dtype, seed=0, v_head_dim=None):
    """q, k, v and out's gradient; v (and out) of ``v_head_dim`` when given (MLA)."""
    v_head_dim = v_head_dim or head_dim
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(2, n, seq, head_dim, generator=gen, dtype=dtype) for n in (heads, kv_heads))
    v = torch.randn(2, kv_heads, seq, v_head_dim, generator=gen, dtype=dtype)
    dout = torch.randn(2, heads, seq, v_head_dim, generator=gen, dtype=dtype)
    return q, k, v, dout


def cuda_kernel(kernel: str) -> kernels.Kernel:
    """The adapter's CUDA kernel entry (on CPU tensors: its kernels are the stand-ins)."""
    path = {"flash_attn": (kernels._flash_attn_forward, kernels._flash_attn_backward),
            "aten_flash": (kernels._cuda_forward, kernels._cuda_backward)}[kernel]
    return kernels.Kernel(*path, kernel, kernels.CUDA_HEAD_DIM_MULTIPLE)


# --- layout: LSE / out / dout reach the kernels contiguous ------------------------

def test_adapter_hands_kernels_contiguous_row_slices(stand_ins, monkeypatch):
    """The ring's causal blocks pass rows [S/2:] of out and lse; the kernel must see those rows."""
    monkeypatch.setattr(kernels, "sdpa_flash_cpu_backward", strict_flash_backward)
    q, k, v, dout = random_qkv_dout(4, 2, 16, 8, torch.float64)
    out, lse = sdpa_flash_cpu(q, k, v, False, 8 ** -0.5)
    rows = slice(8, None)
    got = kernels.attention_backward(dout[:, :, rows], q[:, :, rows], k, v, out[:, :, rows],
                                     lse[:, :, rows], is_causal=False, scale=8 ** -0.5)
    want = sdpa_flash_cpu_backward(*(t[:, :, rows].contiguous() for t in (dout, q)), k, v,
                                   out[:, :, rows].contiguous(), lse[:, :, rows].contiguous(),
                                   False, 8 ** -0.5)
    assert max(relative_errors(got, want)) < TOLERANCE[torch.float64]


def _ring_under_strict_kernels(rank, world, kernel, dtype, head_dim, v_head_dim):
    """cp=2: each rank's blocks include a half-row block (rows S/2: of out and lse)."""
    # CPU tensors routed to a CUDA path of the adapter, in this spawned rank only
    if kernel == "flash_attn":
        import flash_attn  # noqa: F401  the stand-in registers torch.ops.flash_attn.*
    else:
        kernels.sdpa_flash_cuda = strict_flash_forward
        kernels.sdpa_flash_cuda_backward = strict_flash_backward
    kernels._kernel = lambda q: cuda_kernel(kernel)
    mesh = init_mesh(hp=1, cp=world)
    seq = 2 * sequence_divisor(world, 1)
    index = mesh_token_indices(seq, mesh)
    q, k, v, dout = random_qkv_dout(4, 2, seq, head_dim, dtype, seed=7, v_head_dim=v_head_dim)
    want = reference(q, k, v, dout, True)
    local = [t[:, :, index].requires_grad_() for t in (q, k, v)]
    out = attention_2d(*local, is_causal=True, **mesh.attention_kwargs())
    got = (out, *torch.autograd.grad(out, local, dout[:, :, index]))
    return dict(zip(("out", "dq", "dk", "dv"),
                    relative_errors(got, (w[:, :, index] for w in want))))


@pytest.mark.parametrize("kernel, dtype, head_dim, v_head_dim",
                         [("aten_flash", torch.float64, 16, 16),
                          ("flash_attn", torch.float32, 12, 12),
                          ("aten_flash", torch.float64, 24, 16)])  # MLA: V narrower than Q/K
def test_ring_attention_exact_under_strict_kernels(stand_ins, kernel, dtype, head_dim, v_head_dim):
    errors = run_distributed(_ring_under_strict_kernels, 2, kernel, dtype, head_dim, v_head_dim,
                             timeout=120)
    assert all(e < TOLERANCE[dtype] for rank in errors for e in rank.values()), errors


# --- PyTorch's CUDA flash kernel: one head dim, padded to a multiple of 8 ---------

# (q/k head dim, v head dim): padded to 16; MLA's V narrower and wider than Q/K
HEAD_DIMS = [(12, 12), (16, 16), (16, 12), (12, 16)]


@pytest.mark.parametrize("head_dim, v_head_dim", HEAD_DIMS)
def test_cuda_flash_path_pads_head_dims(stand_ins, monkeypatch, head_dim, v_head_dim):
    monkeypatch.setattr(kernels, "sdpa_flash_cuda", strict_flash_forward)
    monkeypatch.setattr(kernels, "sdpa_flash_cuda_backward", strict_flash_backward)
    monkeypatch.setattr(kernels, "_kernel", lambda q: cuda_kernel("aten_flash"))
    q, k, v, dout = random_qkv_dout(4, 2, 16, head_dim, torch.float64, v_head_dim=v_head_dim)
    scale = 0.3  # not 1/sqrt(any head dim): the caller's scale goes to the kernel unchanged
    out, lse = kernels.attention_forward(q, k, v, is_causal=True, scale=scale)
    grads = kernels.attention_backward(dout, q, k, v, out, lse, is_causal=True, scale=scale)
    want = reference(q, k, v, dout, True, scale)
    assert [t.shape for t in (out, *grads)] == [dout.shape, q.shape, k.shape, v.shape]
    assert max(relative_errors((out, *grads), want)) < TOLERANCE[torch.float64]


# --- flash-attn 2.7-2.8: torch.ops.flash_attn.* -------------------------------------

@pytest.mark.parametrize("head_dim, v_head_dim", HEAD_DIMS)
def test_flash_attn_adapter_through_flash_attn_ops(flash_attn_stand_in, monkeypatch, head_dim,
                                                   v_head_dim):
    """The adapter's flash-attn path (CUDA-only in use) on CPU through the stand-in's
    torch.ops.flash_attn ops: layout (B, S, H, D), one head dim padded to 16, GQA."""
    assert kernels._flash_attn_usable()
    monkeypatch.setattr(kernels, "_kernel", lambda q: cuda_kernel("flash_attn"))
    q, k, v, dout = random_qkv_dout(4, 2, 16, head_dim, torch.float32, v_head_dim=v_head_dim)
    out, lse = kernels.attention_forward(q, k, v, is_causal=True, scale=0.3)
    grads = kernels.attention_backward(dout, q, k, v, out, lse, is_causal=True, scale=0.3)
    want = reference(q, k, v, dout, True, 0.3)
    assert lse.dtype == torch.float32 and lse.shape == q.shape[:3]
    assert max(relative_errors((out, *grads), want)) < TOLERANCE[torch.float32]


# --- CUDA graphs: ops that communicate or move data to the host ---------------------

@pytest.mark.parametrize("op", ["ring_attention_fwd", "ring_attention_bwd", "masked_attention_fwd",
                                "masked_attention_bwd", "offload", "reload"])
def test_communicating_ops_are_cudagraph_unsafe(op):
    """Our ops that talk or copy to the host eagerly.  The SeqAlltoAll is functional
    collectives, which Inductor itself knows how to treat."""
    import loong_compile.ops.offload  # noqa: F401  registers loong::offload / loong::reload

    assert torch.Tag.cudagraph_unsafe in getattr(torch.ops.loong, op).default.tags


# --- enable_gqa=False means SDPA's semantics: one KV head broadcasts, others must match -

def test_attention_2d_honours_enable_gqa_false():
    q, k, v, _ = random_qkv_dout(4, 2, 16, 8, torch.float64)
    with pytest.raises(LoongShapeError, match="enable_gqa=False"):
        attention_2d(q, k, v, is_causal=True, enable_gqa=False)
    k1, v1 = k[:, :1], v[:, :1]
    got = attention_2d(q, k1, v1, is_causal=True, enable_gqa=False)
    want = F.scaled_dot_product_attention(q, k1, v1, is_causal=True, enable_gqa=False)
    assert (got - want).abs().max() < TOLERANCE[torch.float64]
