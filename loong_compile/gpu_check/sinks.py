"""gpu-check's attention-sinks check: 2D-Attention's ``sinks=`` through the CUDA kernels (bf16,
causal and windowed, GQA) against the one-process definition in float64, the sinks' gradient
included, and what the sinks cost beside the same attention without them."""

from __future__ import annotations

import torch

from loong_compile.gpu_check.measure import relative_error, require_cuda

TOLERANCE = 2e-2   # bf16, as the other attention checks


def _run(q, k, v, sinks, dout, window):
    """(out, dq, dk, dv[, dsinks]) of 2D-Attention on one GPU; ``sinks`` None: without sinks."""
    from loong_compile.ops import attention_2d

    leaves = [t.detach().requires_grad_() for t in (q, k, v, sinks) if t is not None]
    out = attention_2d(*leaves[:3], is_causal=True, window=window,
                       sinks=leaves[3] if sinks is not None else None)
    return (out.detach(), *torch.autograd.grad(out, leaves, dout))


def _reference(q, k, v, sinks, dout, window):
    from loong_compile.ops.attention.sinks import sdpa_with_sinks

    q, k, v, sinks, dout = (t.double().detach().requires_grad_() for t in (q, k, v, sinks, dout))
    seq, groups = q.size(2), q.size(1) // k.size(1)
    rows = torch.arange(seq, device=q.device)[:, None]
    cols = torch.arange(seq, device=q.device)[None, :]
    keep = (cols <= rows) & ((rows - cols < window) if window else True)
    out = sdpa_with_sinks(q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1), sinks,
                          attn_mask=keep)
    return (out.detach(), *torch.autograd.grad(out, (q, k, v, sinks), dout))


def _elapsed_ms(fn, repeats: int = 5) -> float:
    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeats


def check_sinks(figures: dict) -> str:
    """bf16 attention with sinks (8 heads, 2 KV heads, 4096 tokens), causal and windowed."""
    device = require_cuda()
    gen = torch.Generator(device).manual_seed(2)
    q, dout = (torch.randn((1, 8, 4096, 64), device=device, dtype=torch.bfloat16, generator=gen)
               for _ in range(2))
    k, v = (torch.randn((1, 2, 4096, 64), device=device, dtype=torch.bfloat16, generator=gen)
            for _ in range(2))
    sinks = torch.randn(8, device=device, dtype=torch.bfloat16, generator=gen) * 2
    worst = 0.0
    for window in (None, 128):
        got, want = _run(q, k, v, sinks, dout, window), _reference(q, k, v, sinks, dout, window)
        for name, g, w in zip(("out", "dq", "dk", "dv", "dsinks"), got, want):
            figures[f"{name}{'' if window is None else ' window'}"] = error = round(
                relative_error(g, w), 5)
            worst = max(worst, error)
    assert worst <= TOLERANCE, f"relative error {worst:.3g} > {TOLERANCE}: {figures}"
    with_sinks = _elapsed_ms(lambda: _run(q, k, v, sinks, dout, None))
    without = _elapsed_ms(lambda: _run(q, k, v, None, dout, None))
    figures["ms fwd+bwd with sinks"] = round(with_sinks, 3)
    figures["ms without"] = round(without, 3)
    return (f"out/dq/dk/dv/dsinks within {worst:.3g} of float64; fwd+bwd {with_sinks:.2f} ms with "
            f"sinks, {without:.2f} ms without")

