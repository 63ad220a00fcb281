"""gpu-check's checks of the CUDA paths; each ``check_*(figures) -> str`` raises ``Skip``
without a CUDA GPU (or what it needs) and ``AssertionError`` when the GPU disagrees."""

from __future__ import annotations

import contextlib
import itertools
import time

import torch

from loong_compile.gpu_check.loopback import ring_attention, sdpa_reference
from loong_compile.gpu_check.masked import check_masked_attention
from loong_compile.gpu_check.measure import relative_error, require_cuda
from loong_compile.gpu_check.report import Skip
from loong_compile.gpu_check.sinks import check_sinks

# Largest error relative to the reference's largest magnitude a half-precision user
# accepts from an attention kernel (bf16 keeps 8 bits of mantissa, fp16 11).
TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 5e-3}


def _kernel_adapters() -> list[str]:
    """The CUDA adapters to check: PyTorch's flash kernel, and flash-attn when it is usable."""
    from loong_compile.ops.attention import kernels

    return ["aten_flash_cuda"] + (["flash_attn"] if kernels._flash_attn_usable() else [])


def _with_adapter(name: str):
    """A context in which the kernel adapter picks ``name`` (through the public entry points,
    which are what the ring calls: the layout contract is checked too)."""
    from unittest import mock

    from loong_compile.ops.attention import kernels

    return mock.patch.object(kernels, "_flash_attn_usable", lambda: name == "flash_attn")


def _ring_blocks(q, k, v):
    """The blocks a zigzag ring computes: own (causal), a lower rank's first half of keys
    (all rows), a higher rank's keys (second half of rows): strided views, as in the ring."""
    half = q.size(2) // 2
    return [("own causal", q, k, v, True),
            ("first half of keys", q, k[:, :, :half], v[:, :, :half], False),
            ("second half of rows", q[:, :, half:], k, v, False)]


def check_kernels(figures: dict) -> str:
    """Kernel adapters against SDPA (float64 reference), bf16 and fp16, forward and backward."""
    from loong_compile.ops.attention import kernels

    device = require_cuda()
    gen = torch.Generator(device).manual_seed(0)
    errors = []
    # (q/k head dim, v head dim): Llama's, and DeepSeek-V3's MLA (v padded to 192 for the kernels)
    for (head_dim, v_head_dim), dtype in itertools.product(((128, 128), (192, 128)), TOLERANCE):
        q = torch.randn((1, 8, 2048, head_dim), device=device, dtype=dtype, generator=gen)
        k, v = (torch.randn((1, 2, 2048, d), device=device, dtype=dtype, generator=gen)
                for d in (head_dim, v_head_dim))
        for name in _kernel_adapters():
            for block, bq, bk, bv, causal in _ring_blocks(q, k, v):
                dout = torch.randn((*bq.shape[:3], v_head_dim), device=device, dtype=dtype,
                                   generator=gen)
                scale = bq.size(-1) ** -0.5
                with _with_adapter(name):
                    assert kernels.kernel_name(bq) == name, kernels.kernel_name(bq)
                    out, lse = kernels.attention_forward(bq, bk, bv, is_causal=causal, scale=scale)
                    # the ring hands the backward row slices of its LSE: strided
                    lse = torch.cat([lse, lse], dim=-1)[..., :lse.size(-1)]
                    dq, dk, dv = kernels.attention_backward(dout, bq, bk, bv, out, lse,
                                                            is_causal=causal, scale=scale)
                want = sdpa_reference(*(t.double() for t in (bq, bk, bv, dout)), is_causal=causal)
                err = max(relative_error(g, w) for g, w in zip((out, dq, dk, dv), want))
                mla = "" if head_dim == v_head_dim else f" D={head_dim} D_v={v_head_dim}"
                key = f"{name} {str(dtype)[6:]} {block}{mla}"
                figures[key] = round(err, 5)
                if err > TOLERANCE[dtype]:
                    errors.append(f"{key}: {err:.3g} > {TOLERANCE[dtype]}")
    assert not errors, "; ".join(errors)
    return f"{len(figures)} kernel/dtype/block cases within {TOLERANCE[torch.bfloat16]} (bf16), " \
           f"{TOLERANCE[torch.float16]} (fp16) of float64 SDPA"


def check_double_ring(figures: dict) -> str:
    """Double-Ring (cp=4, inner ring 2) on one GPU, bf16, causal, GQA, against SDPA."""
    device = require_cuda()
    gen = torch.Generator(device).manual_seed(1)
    q = torch.randn((1, 8, 4096, 128), device=device, dtype=torch.bfloat16, generator=gen)
    k, v = (torch.randn((1, 2, 4096, 128), device=device, dtype=torch.bfloat16, generator=gen)
            for _ in range(2))
    dout = torch.randn_like(q)
    got = ring_attention(q, k, v, dout, cp=4, inner_ring=2, is_causal=True)
    want = sdpa_reference(*(t.double() for t in (q, k, v, dout)), is_causal=True)
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        figures[name] = round(relative_error(g, w), 5)
    worst = max(figures.values())
    assert worst <= TOLERANCE[torch.bfloat16], f"relative error {worst:.3g} > 0.02: {figures}"
    return f"out/dq/dk/dv within {worst:.3g} of float64 SDPA"


def _elapsed_ms(fn) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end)


def check_offload_overlap(figures: dict) -> str:
    """Offload/reload on the side stream: copies hidden behind matmuls, data bit-identical."""
    import loong_compile.ops.offload  # noqa: F401  (defines torch.ops.loong.offload / reload / wait_tensor)

    device = require_cuda()
    acts = [torch.randn(64 << 20, device=device, dtype=torch.bfloat16) for _ in range(4)]
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)

    def compute():
        for _ in range(20):
            a @ a

    def copies():
        hosts = [torch.ops.loong.offload(x) for x in acts]
        return [torch.ops.loong.wait_tensor(torch.ops.loong.reload(
            torch.ops.loong.wait_tensor(h, None), device), None) for h in hosts]

    compute(), copies()  # warm up: pinned buffers, cuBLAS
    t_compute, t_copy = _elapsed_ms(compute), _elapsed_ms(copies)
    back: list = []
    t_both = _elapsed_ms(lambda: (back.extend([torch.ops.loong.offload(x) for x in acts]),
                                  compute()))
    reloaded = [torch.ops.loong.wait_tensor(torch.ops.loong.reload(
        torch.ops.loong.wait_tensor(h, None), device), None) for h in back]
    torch.cuda.synchronize()
    offload_ms = t_copy / 2
    hidden = max(0.0, min(1.0, (t_compute + offload_ms - t_both) / offload_ms))
    identical = all(torch.equal(x, y) for x, y in zip(acts, reloaded))
    figures.update(compute_ms=round(t_compute, 2), copy_ms=round(t_copy, 2),
                   offload_with_compute_ms=round(t_both, 2), offload_hidden=round(hidden, 3),
                   bit_identical=identical)
    assert identical, "a reloaded activation differs from the original"
    assert hidden >= 0.5, f"only {hidden:.0%} of the offload time is hidden behind compute"
    return f"{hidden:.0%} of {offload_ms:.1f} ms offload hidden; reload bit-identical"


def _llama(device, layers=8, dim=1024, heads=16):
    try:
        from transformers import LlamaConfig, LlamaForCausalLM
    except ImportError as error:
        raise Skip(f"transformers is not installed ({error}); pip install -e '.[test]'")
    config = LlamaConfig(vocab_size=32000, hidden_size=dim, intermediate_size=4 * dim,
                         num_hidden_layers=layers, num_attention_heads=heads,
                         num_key_value_heads=heads // 4, max_position_embeddings=1 << 15,
                         attn_implementation="sdpa")
    return LlamaForCausalLM(config).to(device=device, dtype=torch.bfloat16)


POLICIES = [("none", {}), ("sc++", {}), ("memo", {"alpha": 0.0}), ("memo", {"alpha": 0.5}),
            ("memo", {"alpha": 1.0})]


def _train_steps(model, ids, options: dict, steps: int, record_layers: int | None = None,
                 **inputs) -> dict:
    """Compile with ``options``, run ``steps`` steps (the model takes ``ids``, labels ``ids``
    unless ``inputs`` say otherwise); peak bytes, step time, report figures.  With
    ``record_layers``, the last step's waits are recorded (``ops.exposure``; not the first,
    which compiles): ``exposed``, ms blocked per layer and kind."""
    from loong_compile.backend import LoongBackend
    from loong_compile.ops.exposure import per_layer, recording

    reports = []
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=LoongBackend(options, on_report=reports.append),
                             fullgraph=True)
    peaks, times, exposed = [], [], {}
    for step in range(steps):
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        recorded = record_layers is not None and step == steps - 1 > 0
        start = time.perf_counter()
        with recording(layers=record_layers) if recorded else contextlib.nullcontext() as records:
            compiled(ids, **{"labels": ids, **inputs}).loss.backward()
            torch.cuda.synchronize()
            if recorded:
                exposed = per_layer(records)
        times.append(time.perf_counter() - start)
        peaks.append(torch.cuda.max_memory_allocated() - base)
        model.zero_grad(set_to_none=True)
    summaries = {(p.name, p.graph_kind): p.summary for r in {id(r): r for r in reports}.values()
                 for p in r.passes}
    return {"peaks": peaks, "step_s": min(times[1:] or times), "summaries": summaries,
            "reserved": torch.cuda.memory_reserved(), "exposed": exposed}


def _summary_value(summaries: dict, key: str) -> int | None:
    values = [s[key] for s in summaries.values() if isinstance(s, dict) and key in s]
    return max(values) if values else None


def check_activation_memory(figures: dict) -> str:
    """Peak device memory and step time per policy against the activations report."""
    device = require_cuda()
    model, ids = _llama(device), torch.randint(0, 32000, (1, 16384), device=device)
    for policy, extra in POLICIES:
        run = _train_steps(model, ids, {"activations": policy, **extra}, steps=3)
        label = policy + (f" alpha={extra['alpha']}" if extra else "")
        figures[label] = {"peak_bytes": max(run["peaks"][1:]), "step_s": round(run["step_s"], 4),
                          "predicted_activation_bytes": _summary_value(run["summaries"],
                                                                       "activation_bytes")}
    none, memo = figures["none"]["peak_bytes"], figures["memo alpha=1.0"]["peak_bytes"]
    assert memo < none, f"memo alpha=1 peak {memo} B is not below none's {none} B"
    return f"peak none {none / 2**30:.2f} GiB, memo alpha=1 {memo / 2**30:.2f} GiB"


def check_memory_plan(figures: dict) -> str:
    """memory_plan=True on Inductor's CUDA code: peak vs the plan's arena, no growth in 20 steps."""
    from loong_compile import _compat

    device = require_cuda()
    if not _compat.has("inductor_pool_planning"):
        raise Skip(_compat.warn_degraded("inductor_pool_planning"))
    model, ids = _llama(device, layers=4), torch.randint(0, 32000, (1, 8192), device=device)
    run = _train_steps(model, ids, {"memory_plan": True}, steps=20)
    arena = _summary_value(run["summaries"], "arena_bytes")
    figures.update(arena_bytes=arena, peak_bytes_first=run["peaks"][1], peak_bytes_last=run["peaks"][-1],
                   reserved_bytes=run["reserved"], step_s=round(run["step_s"], 4))
    assert arena is not None, "the memory plan reported no arena: the hook did not run"
    assert run["peaks"][-1] <= run["peaks"][1], \
        f"peak grew from {run['peaks'][1]} to {run['peaks'][-1]} bytes over 20 steps"
    return f"arena {arena / 2**20:.1f} MiB; peak {run['peaks'][-1] / 2**20:.1f} MiB, steady over 20 steps"


def _exposed_per_layer(model, ids, options: dict, layers: int, **inputs) -> tuple[dict, dict, float]:
    """Three steps, the last recorded: ms blocked per layer and kind, the ``overlap`` records
    of the generated code, the step's seconds."""
    import tempfile

    with tempfile.TemporaryDirectory() as dump:      # dump_dir: the report reads the generated code
        run = _train_steps(model, ids, {**options, "dump_dir": dump}, steps=3, record_layers=layers,
                           **inputs)
    overlap = {kind: s["kinds"] for (name, kind), s in run["summaries"].items() if name == "overlap"}
    rows = {str(k): {kind: round(v, 3) for kind, v in row.items()} for k, row in sorted(run["exposed"].items())}
    return rows, overlap, run["step_s"]


def _exposed_two_ranks(rank: int, world: int, device_type: str = "cuda", tokens: int = 8192) -> dict:
    """hp = 2 on two GPUs over NCCL: the SeqAlltoAll's waits beside the offloads and reloads."""
    import torch.distributed as dist

    from loong_compile import init_mesh, shard_batch

    device = torch.device(device_type, rank if device_type == "cuda" else None)
    model, ids = _llama(device, layers=4), torch.randint(0, 32000, (1, tokens), device=device)
    dist.broadcast(ids, 0)
    batch = shard_batch(ids, ids, init_mesh(hp=2, cp=1))
    n_labels = (batch.labels != -100).sum()
    dist.all_reduce(n_labels)                                  # label tokens of the whole row
    rows, overlap, step_s = _exposed_per_layer(
        model, batch.input_ids, {"hp": 2, "activations": "memo", "alpha": 0.5, "resident_layers": 0},
        layers=4, position_ids=batch.position_ids, labels=batch.labels, shift_labels=batch.labels,
        num_items_in_batch=int(n_labels))
    return {"exposed_ms_per_layer": rows, "overlap": overlap, "step_s": round(step_s, 4)}


def check_exposed_time(figures: dict) -> str:
    """memo (every layer swapped) on Inductor's CUDA code: the time the compute stream blocks on
    each layer's offload and reload waits and, with two GPUs, on its all-to-alls at hp = 2 (CUDA
    events, ``ops.exposure``), beside the compute kernels the generated code schedules between
    each start and its wait."""
    from loong_compile.testing import run_distributed

    device = require_cuda()
    model, ids = _llama(device, layers=4), torch.randint(0, 32000, (1, 8192), device=device)
    layers, figures["overlap"], step_s = _exposed_per_layer(
        model, ids, {"activations": "memo", "alpha": 0.5, "resident_layers": 0}, layers=4)
    figures["exposed_ms_per_layer"], figures["step_s"] = layers, round(step_s, 4)
    assert sorted(layers) == ["0", "1", "2", "3"], f"waits recorded for layers {sorted(layers)}, want 0-3"
    worst = max(sum(v for k, v in row.items() if not k.endswith("_waits")) for row in layers.values())
    if torch.cuda.device_count() < 2:
        figures["hp2"] = "not run: the all-to-all at hp = 2 needs two GPUs (NCCL); this machine has one"
        return f"exposed offload + reload time per layer at most {worst:.2f} ms (4 layers, 8192 tokens)"
    figures["hp2"] = hp2 = run_distributed(_exposed_two_ranks, 2, timeout=600, backend="nccl")[0]
    exposed = max(row.get("collective", 0.0) for row in hp2["exposed_ms_per_layer"].values())
    return (f"exposed offload + reload time per layer at most {worst:.2f} ms; at hp = 2 the "
            f"all-to-alls expose at most {exposed:.2f} ms per layer (4 layers, 8192 tokens)")


CHECKS = [("kernels", check_kernels), ("double_ring", check_double_ring),
          ("masked_attention", check_masked_attention), ("sinks", check_sinks),
          ("offload_overlap", check_offload_overlap), ("activation_memory", check_activation_memory),
          ("memory_plan", check_memory_plan), ("exposed_time", check_exposed_time)]
