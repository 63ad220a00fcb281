"""Helpers shared by the test modules (test modules import them from here, never from each
other or from conftest.py): the tiny Llama builder, one single-process training step through
a ``LoongBackend`` with a probe pass, the gradient-equality assertion, the multi-rank
section harness and the errors a test reads, the masked-attention reference and attention
with transformers' own masks, the scans' recurrences token by token and document by document,
and where the stand-in kernels live.
"""

from __future__ import annotations

import re

import copy
import math
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from loong_compile import LoongBackend
from loong_compile.passes import library_passes

VOCAB = 256
# CPU stand-ins of the CUDA kernels (flash-attn), importable once a test puts this on sys.path
STAND_INS = Path(__file__).resolve().parent / "stand_ins"


def tiny_llama(hf: bool = False, layers: int = 2, heads: int = 4, kv_heads: int = 2, ffn: int = 128,
               dim: int = 64, max_positions: int | None = None) -> torch.nn.Module:
    """A small Llama, seeded: the example model (examples/llama.py) or, with ``hf``,
    transformers' ``LlamaForCausalLM`` (SDPA attention) of the same sizes."""
    torch.manual_seed(0)
    if not hf:
        from llama import Llama, LlamaConfig

        return Llama(LlamaConfig(dim=dim, n_layers=layers, n_heads=heads, n_kv_heads=kv_heads, ffn_dim=ffn))
    from transformers import LlamaConfig, LlamaForCausalLM

    extra = {} if max_positions is None else {"max_position_embeddings": max_positions}
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=VOCAB, hidden_size=dim, intermediate_size=ffn, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, attn_implementation="sdpa", **extra))


def example_llama() -> torch.nn.Module:
    return tiny_llama()


def hf_llama() -> torch.nn.Module:
    return tiny_llama(hf=True, max_positions=256)


class MixingBlock(torch.nn.Module):
    """Attention, then a cumulative sum along the sequence: not token-wise."""

    def __init__(self, dim=32, heads=2, dropout=0.0):
        super().__init__()
        self.heads, self.dropout = heads, dropout
        self.qkv = torch.nn.Linear(dim, 3 * dim, bias=False)
        self.mix = torch.nn.Linear(dim, dim)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        x = x + F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, d)
        h = torch.tanh(self.mix(x))
        if self.dropout:
            h = F.dropout(h, self.dropout, training=True)
        return x + torch.cumsum(h, dim=1) / s


class MixingModel(torch.nn.Module):
    def __init__(self, dropout=0.0):
        super().__init__()
        self.embed = torch.nn.Embedding(256, 32)
        self.blocks = torch.nn.ModuleList(MixingBlock(dropout=dropout) for _ in range(2))
        self.out = torch.nn.Linear(32, 256)

    def forward(self, ids):
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.out(x)


def mixing_model(dropout: float):
    """A builder of a two-block model whose blocks mix tokens after attention (a cumsum along
    the sequence), with dropout if ``dropout`` > 0."""
    def make():
        torch.manual_seed(0)
        return MixingModel(dropout)
    return make


def assert_same_loss_and_grads(got: tuple[torch.Tensor, dict], want: tuple[torch.Tensor, dict],
                               rtol: float = 1e-5, atol: float = 1e-7) -> None:
    """Same loss and same gradient for every parameter, none of which vanished."""
    (loss, grads), (ref_loss, ref_grads) = got, want
    torch.testing.assert_close(loss, ref_loss, rtol=rtol, atol=0)
    assert grads.keys() == ref_grads.keys()
    for name in grads:
        torch.testing.assert_close(grads[name], ref_grads[name], rtol=rtol, atol=atol, msg=name)
        assert grads[name].abs().sum() > 0, name   # a vanished gradient is not "equal"


# -- one training step through the backend, single process -----------------------------------

# MEMO's LP inputs given, so no test measures the machine: budgets with room to spare.
BUDGET = {"host_bandwidth": 1e12, "host_memory": 1e12, "layer_time": 1.0}
BATCH, SEQ = 2, 64
DIM, HEADS, KV_HEADS, FFN = 64, 4, 2, 128     # both models of MODELS
MODELS = {"example": example_llama, "hf": hf_llama}


class Probe:
    """A split-stage pass that runs after the library's and keeps both graphs."""

    name, stage = "probe", "split"

    def __init__(self):
        self.graphs = []

    def enabled(self, config):
        return True

    def run(self, split, ctx):
        self.graphs.append(split)
        self.state = ctx.state
        return {}


def token_ids(seq: int = SEQ, batch: int = BATCH) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(1))


_captured: dict[str, tuple] = {}


def captured(name: str, make: Callable[[], torch.nn.Module] | None = None):
    """(model, ids, Dynamo's graph, its example inputs) of a model, traced once per name."""
    if name not in _captured:
        model, ids, graphs = (make or MODELS[name])(), token_ids(), []
        torch._dynamo.reset()
        torch.compile(model, backend=lambda gm, ex: graphs.append((gm, ex)) or gm.forward,
                      fullgraph=True)(ids)
        (gm, example), = graphs
        _captured[name] = (model, ids, gm, example)
    return _captured[name]


def run_step(name: str, options, probe: Probe | None = None, lowering="aot_eager", make=None):
    """One forward + backward of model ``name`` through a LoongBackend with ``options``:
    (loss, grads by parameter name, the graph's report).  Each model is traced by Dynamo once
    (``captured``) and its graph handed to a fresh backend: the backend's own stages (joint,
    split, lowering) all run every time."""
    model, ids, gm, example = captured(name, make)
    model.zero_grad(set_to_none=True)
    reports = []
    passes = library_passes() + ([probe] if probe else [])
    backend = LoongBackend({"lowering": lowering, **BUDGET, **options}, passes=passes,
                           on_report=reports.append)
    outputs = backend(copy.deepcopy(gm), example)(*example)
    logits, = [o for o in outputs if tuple(o.shape) == (*ids.shape, VOCAB)]
    loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}, reports[-1]


# -- multi-rank tests: named sections, each failure kept as text -------------------------------

def sharded_step(model: torch.nn.Module, ids: torch.Tensor, mesh, options, passes=None):
    """One training step of ``model`` through a LoongBackend with ``options`` on this rank's
    tokens of ``ids``: (loss, gradients all-reduced over the world, the graph's report)."""
    import torch.distributed as dist

    from loong_compile import shard_batch

    batch = shard_batch(ids, ids, mesh)
    reports = []
    backend = LoongBackend(options, passes=passes, on_report=reports.append)
    out = torch.compile(model, backend=backend, fullgraph=True)(batch.input_ids,
                                                                position_ids=batch.position_ids)
    logits = out if isinstance(out, torch.Tensor) else out.logits
    loss = F.cross_entropy(logits.flatten(0, 1), batch.labels.flatten(), ignore_index=-100,
                           reduction="sum") / (ids.shape[0] * (ids.shape[1] - 1))
    loss.backward()
    for p in model.parameters():
        dist.all_reduce(p.grad)
    dist.all_reduce(loss)
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}, reports[-1]


class Sections:
    """What one rank's run of a multi-rank suite returns: each named section's result, or
    ``("failed", traceback)`` so one failing part does not hide the others."""

    def __init__(self):
        self.results: dict[Any, Any] = {}

    def run(self, name: Any, fn: Callable, *args: Any) -> None:
        try:
            self.results[name] = fn(*args)
        except Exception:  # noqa: BLE001 - section_results reports it
            self.results[name] = ("failed", traceback.format_exc())


def section_results(per_rank: list[dict], name: Any) -> list[Any]:
    """Section ``name``'s result on every rank; fails naming the rank whose section raised."""
    for rank, result in enumerate(per_rank):
        value = result[name]
        assert not (isinstance(value, tuple) and value[:1] == ("failed",)), f"rank {rank}: {value[1]}"
    return [result[name] for result in per_rank]


def loong_error_in(exc: BaseException | None):
    """The ``LoongError`` behind an exception (Dynamo wraps backend errors in
    ``BackendCompilerFailed``), or None when there is none."""
    from loong_compile.errors import LoongError

    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, LoongError):
            return exc
        exc = getattr(exc, "inner_exception", None) or exc.__cause__ or exc.__context__
    return None


def error_of(fn) -> str:
    """``"ErrorClass: message"`` of what fn raised (unwrapping Dynamo's BackendCompilerFailed),
    or "no error"."""
    try:
        fn()
    except Exception as e:  # noqa: BLE001
        inner = getattr(e, "inner_exception", e)
        return f"{type(inner).__name__}: {inner}"
    return "no error"


def still_in_step() -> bool:
    """An all_reduce over the world: it returns only if no rank was left inside a collective."""
    import torch.distributed as dist

    t = torch.ones(1)
    dist.all_reduce(t)
    return t.item() == dist.get_world_size()


def allowed_pairs(document_ids: torch.Tensor, is_causal: bool, window: int | None,
                  positions: torch.Tensor | None = None) -> torch.Tensor:
    """``(B, S, S)`` bool: query i may see key j (issue 13's rule, from first principles);
    ``positions`` ``(B, S)``: each token's position in its document, where it is not its
    global position (documents in the balanced order)."""
    seq = document_ids.size(1)
    i, j = torch.arange(seq).unsqueeze(1), torch.arange(seq).unsqueeze(0)
    if positions is not None:
        i, j = positions.unsqueeze(2), positions.unsqueeze(1)
    allowed = (document_ids.unsqueeze(2) == document_ids.unsqueeze(1)) & \
        (document_ids.unsqueeze(2) >= 0)
    if is_causal:
        allowed &= j <= i
    if window is not None:
        allowed &= i - j < window
    return allowed


def masked_reference(q, k, v, dout, document_ids, is_causal, window, positions=None):
    """One process, float64, the explicit mask: ``(out, lse, dq, dk, dv)``; a row that sees
    nothing gives out 0, lse -inf and zero gradients (``positions``: as ``allowed_pairs``)."""
    q, k, v = (t.detach().double().requires_grad_() for t in (q, k, v))
    if document_ids is None:
        document_ids = torch.zeros(q.size(0), q.size(2), dtype=torch.long)
    allowed = allowed_pairs(document_ids, is_causal, window, positions).unsqueeze(1)
    sees = allowed.any(-1)
    kv = [t.repeat_interleave(q.size(1) // t.size(1), dim=1) for t in (k, v)]
    scores = (q @ kv[0].transpose(-1, -2) / math.sqrt(q.size(-1))).masked_fill(~allowed, -math.inf)
    scores = torch.where(sees.unsqueeze(-1), scores, torch.zeros_like(scores))
    out = (scores.softmax(-1) @ kv[1]) * sees.unsqueeze(-1)
    lse = torch.logsumexp(scores, -1).masked_fill(~sees, -math.inf)
    grads = torch.autograd.grad(out, (q, k, v), dout.double())
    return out.detach(), lse.detach(), *grads


def masked_relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """Max relative error over the finite entries; inf unless the infinite entries match."""
    got = got.double()
    if not torch.equal(torch.isinf(got), torch.isinf(want)):
        return math.inf
    finite = ~torch.isinf(want)
    diff = (got[finite] - want[finite]).abs().max()
    return (diff / want[finite].abs().max().clamp_min(1e-300)).item()


def hf_masked_attention(make: str, window: int | None = None, chunk: int | None = None,
                        **mask_kwargs) -> Callable:
    """``fn(q, k, v, position_ids, attention_mask=None)``: SDPA with the mask transformers'
    ``masking_utils.<make>`` builds, called as its models call it (no cache; ``mask_kwargs``
    such as ``or_mask_function`` passed on)."""
    import transformers.masking_utils as masking
    from transformers import MistralConfig

    config = MistralConfig(hidden_size=16, num_attention_heads=2, sliding_window=window,
                           attn_implementation="sdpa")
    config.attention_chunk_size = chunk

    def fn(q, k, v, position_ids, attention_mask=None):
        mask = getattr(masking, make)(config=config, inputs_embeds=q[:, 0],
                                      attention_mask=attention_mask, past_key_values=None,
                                      position_ids=position_ids, **mask_kwargs)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    return fn


def sequential_recurrence(q, k, v, g, beta=None) -> torch.Tensor:
    """The gated recurrence token by token (ops/scans/gated_scan.py's docstring), in the inputs' dtype:
    ``q``, ``k`` ``(B, H, T, dk)``, ``v`` ``(B, H, T, dv)``, ``g`` (log-decay) and ``beta`` (the
    delta rule's rate, or None: no delta rule) ``(B, H, T)`` -> ``(B, H, T, dv)``."""
    state, out = q.new_zeros(*q.shape[:2], q.size(-1), v.size(-1)), []
    for t in range(q.size(2)):
        state = state * g[:, :, t].exp()[..., None, None]
        kt = k[:, :, t, :, None]
        written = v[:, :, t] if beta is None else (v[:, :, t] - (state * kt).sum(-2)) * beta[:, :, t, None]
        state = state + kt * written.unsqueeze(-2)
        out.append((state * q[:, :, t, :, None]).sum(-2))
    return torch.stack(out, 2)


def gated_delta_recurrence(query, key, value, g, beta, use_qk_l2norm_in_kernel=False, **kwargs):
    """transformers' ``torch_chunk_gated_delta_rule`` (its arguments; the state of a cache
    zeros) token by token in the inputs' dtype: ``sequential_recurrence`` with the delta rule."""
    heads = value.size(2)
    if key.size(2) != heads:
        query, key = (x.repeat_interleave(heads // key.size(2), dim=2) for x in (query, key))
    query, key, value, g, beta = (x.transpose(1, 2) for x in (query, key, value, g, beta))
    if use_qk_l2norm_in_kernel:
        query, key = (x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6) for x in (query, key))
    out = sequential_recurrence(query * query.size(-1) ** -0.5, key, value, g, beta)
    state = query.new_zeros(*query.shape[:2], query.size(-1), value.size(-1))  # a cache's only
    return out.transpose(1, 2), state if kwargs.get("output_final_state") else None


def mamba2_recurrence(hidden_states, dt, A, B, C, chunk_size=None, D=None, dt_bias=None,
                      initial_states=None, dt_softplus=False, dt_limit=(0.0, float("inf")),
                      return_final_states=False, **kwargs):
    """transformers' ``mamba2_chunk_scan`` (its arguments; the state of a cache zeros) token by
    token in the inputs' dtype: ``sequential_recurrence`` without the delta rule."""
    if dt_bias is not None:
        dt = dt + dt_bias.to(dt.dtype)
    if dt_softplus:
        dt = F.softplus(dt)
    dt = dt.clamp(min=dt_limit[0], max=dt_limit[1])
    heads = hidden_states.size(2)
    B, C = (x.repeat_interleave(heads // x.size(2), dim=2) for x in (B, C))
    q, k, v, g = (x.transpose(1, 2) for x in (C, B, hidden_states * dt[..., None], A * dt))
    out = sequential_recurrence(q, k, v, g).transpose(1, 2).contiguous()   # the model views it
    if D is not None:
        out = out + D[..., None] * hidden_states
    state = out.new_zeros(out.size(0), heads, out.size(-1), B.size(-1))  # a cache's only
    return (out, state) if return_final_states else out


def each_document_alone(fn: Callable[..., torch.Tensor], rows: list[list[int]], dim: int,
                        *tensors: torch.Tensor) -> torch.Tensor:
    """``fn`` on each packed document alone, the outputs joined: ``rows[b]`` the document lengths
    of batch row ``b``, ``tensors`` ``(B, ..., S, ...)`` with the tokens on ``dim`` (what the
    scans compute for packed documents: each from a zero state, reading no earlier document)."""
    joined = []
    for b, lengths in enumerate(rows):
        starts = [sum(lengths[:i]) for i in range(len(lengths))]
        joined.append(torch.cat([fn(*(t[b:b + 1].narrow(dim, s, n) for t in tensors))
                                 for s, n in zip(starts, lengths)], dim))
    return torch.cat(joined)


def allocated_shapes(code: list[str]) -> list[tuple[int, ...]]:
    """The shape of every buffer Inductor's generated CPU code allocates (``empty_strided_cpu``)."""
    return [tuple(int(d) for d in shape.split(",") if d.strip())
            for source in code for shape in re.findall(r"empty_strided_cpu\(\(([^)]*)\)", source)]


class Holder:
    """A trainer as users write one: the model an attribute, the step a closure over ``self``
    (``lambda batch: self.model(**batch)``): Dynamo's root is the trainer, which is no module."""

    def __init__(self, model: torch.nn.Module):
        self.model = model

    def step(self):
        return lambda *args, **kwargs: self.model(*args, **kwargs)
