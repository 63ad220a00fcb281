"""gpu-check's masked attention: flex_attention's blocks (ops/attention/flex.py) on one GPU.

Exactness: bf16 forward and backward of ``attention_2d`` with packed documents and padding,
and with a sliding window, against a float64 dense reference.  Scale: fwd+bwd time and peak
device memory at 32K and 128K tokens of packed documents against dense causal attention
(the flash kernel) at the same length.  The plan is made once, as a step makes it, and a
first call makes the block masks and compiles flex (its time reported apart); the timed calls
reuse them, as every later layer of a step does."""

from __future__ import annotations

import math
import statistics
import time
from unittest import mock

import torch

from loong_compile.gpu_check.measure import relative_error, require_cuda

TOLERANCE = 2e-2   # bf16, as check_kernels
SCALE_TOKENS = (32768, 131072)


def packed_documents(seq: int, mean: int, device, pad: int = 0, seed: int = 0) -> torch.Tensor:
    """``(1, S)`` ids of documents of lengths uniform in [1, 2·mean-1], the last ``pad`` tokens
    padding (-1)."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 2 * mean, (2 * seq // mean + 2,), generator=gen)
    ids = torch.repeat_interleave(torch.arange(lengths.numel()), lengths)[:seq]
    if pad:
        ids[seq - pad:] = -1
    return ids.unsqueeze(0).to(device)


def _reference(q, k, v, dout, ids, window):
    """float64 dense attention with the explicit mask: ``(out, dq, dk, dv)``."""
    q, k, v = (t.detach().double().requires_grad_() for t in (q, k, v))
    seq = q.size(2)
    i, j = torch.arange(seq, device=q.device).unsqueeze(1), torch.arange(seq, device=q.device)
    allowed = j <= i
    if ids is not None:
        allowed = allowed & (ids[0].unsqueeze(1) == ids[0]) & (ids[0].unsqueeze(1) >= 0)
    if window is not None:
        allowed = allowed & (i - j < window)
    kk, vv = (t.repeat_interleave(q.size(1) // t.size(1), dim=1) for t in (k, v))
    scores = (q @ kk.transpose(-1, -2) / math.sqrt(q.size(-1))).masked_fill(~allowed, -math.inf)
    sees = allowed.any(-1).unsqueeze(-1)
    out = torch.where(sees, scores, 0).softmax(-1) @ vv * sees
    return (out.detach(), *torch.autograd.grad(out, (q, k, v), dout.double()))


def _flex_calls():
    """A context counting the masked blocks that ran on flex, forward and backward."""
    from loong_compile.ops.attention import kernels

    calls = {"forward": 0, "backward": 0}

    def counted(name):
        original = getattr(kernels, f"flex_{name}")

        def run(*args):
            calls[name] += 1
            return original(*args)
        return run
    patches = [mock.patch.object(kernels, f"flex_{n}", counted(n)) for n in calls]
    return calls, patches


def _fwd_bwd(q, k, v, dout, ids=None, window=None, plan=None):
    from loong_compile.ops import attention_2d

    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out = attention_2d(*leaves, is_causal=True, document_ids=ids, window=window, mask_plan=plan)
    return (out.detach(), *torch.autograd.grad(out, leaves, dout))


def check_masked_attention(figures: dict) -> str:
    """flex_attention's masked blocks: exact in bf16 against float64, then memory and time at
    32K and 128K tokens of packed documents against dense causal attention."""
    from loong_compile.ops import masked_attention_plan

    device = require_cuda()
    gen = torch.Generator(device).manual_seed(3)
    calls, patches = _flex_calls()
    for patch in patches:
        patch.start()
    try:
        seq = 4096
        q = torch.randn((1, 8, seq, 128), device=device, dtype=torch.bfloat16, generator=gen)
        k, v = (torch.randn((1, 4, seq, 128), device=device, dtype=torch.bfloat16, generator=gen)
                for _ in range(2))
        dout = torch.randn_like(q)
        cases = {"documents + padding": (packed_documents(seq, 512, device, pad=300), None),
                 "window 1000": (None, 1000)}
        errors = []
        for name, (ids, window) in cases.items():
            got = _fwd_bwd(q, k, v, dout, ids, window)
            want = _reference(q, k, v, dout, ids, window)
            err = max(relative_error(g, w) for g, w in zip(got, want))
            figures[f"{name}: out/dq/dk/dv error"] = round(err, 5)
            if err > TOLERANCE:
                errors.append(f"{name}: {err:.3g} > {TOLERANCE}")
        figures["flex blocks (fwd, bwd)"] = (calls["forward"], calls["backward"])
        assert calls["forward"] and calls["backward"], f"no block ran on flex: {calls}"
        assert not errors, "; ".join(errors)
        for seq in SCALE_TOKENS:
            q = torch.randn((1, 8, seq, 128), device=device, dtype=torch.bfloat16, generator=gen)
            k, v = (torch.randn((1, 8, seq, 128), device=device, dtype=torch.bfloat16,
                                generator=gen) for _ in range(2))
            dout = torch.randn_like(q)
            ids = packed_documents(seq, seq // 8, device)
            for kind, doc_ids in (("dense causal", None), ("documents (flex)", ids)):
                plan = None
                start = time.perf_counter()
                if doc_ids is not None:  # once per step: the plan, then the block masks
                    plan = masked_attention_plan(doc_ids, seq, True, 0, 1, "")
                _fwd_bwd(q, k, v, dout, doc_ids, plan=plan)  # warm-up: compiles flex
                torch.cuda.synchronize()
                first_s = time.perf_counter() - start
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
                times = []
                for _ in range(3):
                    start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
                    start.record()
                    _fwd_bwd(q, k, v, dout, doc_ids, plan=plan)
                    end.record()
                    torch.cuda.synchronize()
                    times.append(start.elapsed_time(end))
                peak = (torch.cuda.max_memory_allocated() - base) / 2**30
                figures[f"{seq // 1024}K {kind}"] = {"ms": round(statistics.median(times), 1),
                                                    "peak GiB": round(peak, 2),
                                                    "first call s": round(first_s, 1)}
    finally:
        for patch in patches:
            patch.stop()
    big = SCALE_TOKENS[-1] // 1024
    return (f"bf16 within {max(v for k, v in figures.items() if k.endswith('error')):.3g} of "
            f"float64; {big}K tokens: documents {figures[f'{big}K documents (flex)']} vs dense "
            f"causal {figures[f'{big}K dense causal']}")
