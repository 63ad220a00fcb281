"""The longest sequence one device trains, plain Inductor against ``backend="loong"`` (issue 36).

    python benchmarks/longest_sequence.py --model llama3.2-1b --device cuda            # a GPU
    python benchmarks/longest_sequence.py --model tiny --cap-mib 48 --start 256        # CPU
    python benchmarks/longest_sequence.py --model tiny-1b --cap-mib 256 --start 1024 \
        --variants loong-sc++ "loong-sc++ +tiles" --tile-tokens 1024                     # tiling

The model is a ``loong plan`` preset (or ``tiny``: 2 layers, width 64, a 256-word vocabulary;
``tiny-1b``: Llama-3.2-1B's proportions at 1/16 of its width)
built with transformers from its shape, random weights, bf16 on CUDA (float32 on CPU), AdamW
with its states on the device.  A training step is ``model(ids, attention_mask=mask,
labels=ids).loss`` (a collator's batch: one row, its attention mask all ones) compiled, then
``backward()`` and the optimizer's step.  For each variant, the longest length whose step
completes: lengths double from ``--start`` until a step fails, then bisection between the last
that passed and the first that failed until they are within 1/16 of it (``longest``).  On
CUDA a step fails by running out of memory (caught, the cache emptied; ``--cap-gib`` caps the
process below the device's memory); on CPU by peaking above ``--cap-mib`` (``VmHWM`` above
``VmRSS``, reset with ``/proc/self/clear_refs``).  Each length compiles anew.

At the longest length of each variant: tokens/s of a step after the compiling one, MFU against
the device's bf16 peak with the attention's FLOPs counted causal (half the pairs) and
non-causal, the peak allocated and reserved (CUDA) or above rest (CPU), and ``loong plan
--max-seq --gpus 1`` for the same activation policy (the estimator's prediction; ``full``
for transformers' gradient checkpointing).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path
from typing import Callable

import torch
from lm_head_memory import status_kib

# variant -> (backend, transformers' gradient checkpointing, backend options, estimator policy)
VARIANTS = {
    "inductor": ("inductor", False, {}, "none"),
    "inductor+ckpt": ("inductor", True, {}, "full"),
    "loong-none": ("loong", False, {"activations": "none", "tile_tokens": 0}, "none"),
    "loong-sc++": ("loong", False, {"activations": "sc++", "tile_tokens": 0}, "sc++"),
    "loong-memo": ("loong", False, {"activations": "memo", "tile_tokens": 0}, "memo"),
    "loong-memo+plan": ("loong", False, {"activations": "memo", "memory_plan": True,
                                         "tile_tokens": 0}, "memo"),
    # token tiling (issue 52): the MLPs a tile of --tile-tokens at a time
    "loong-none+tiles": ("loong", False, {"activations": "none"}, "none"),
    "loong-sc++ +tiles": ("loong", False, {"activations": "sc++"}, "sc++"),
}
RESOLUTION = 16   # bisection stops within 1/RESOLUTION of the longest length that passed


def longest(fits: Callable[[int], bool], start: int, limit: int,
            resolution: int = RESOLUTION) -> int:
    """The longest multiple of ``start`` up to ``limit`` for which ``fits`` holds, assuming it
    holds up to some length and not beyond: lengths double from ``start`` until one fails, then
    bisection (on multiples of ``start``) until the passing and the failing lengths are within
    ``1/resolution`` of the passing one.  0 when ``start`` itself fails."""
    if not fits(start):
        return 0
    good = start
    while good * 2 <= limit and fits(good * 2):
        good *= 2
    bad = good * 2 if good * 2 <= limit else limit + start
    while bad - good > max(start, good // resolution):
        middle = (good + bad) // 2 // start * start
        if middle <= good:
            break
        good, bad = (middle, bad) if fits(middle) else (good, middle)
    return good


def model_config(name: str):
    """transformers' config of a preset's shape (Qwen2 for the presets with q/k/v biases)."""
    from transformers import LlamaConfig, Qwen2Config

    if name == "tiny":
        return LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                           attn_implementation="sdpa")
    if name == "tiny-1b":   # Llama-3.2-1B's proportions (hidden : FFN : vocabulary, head
        # width 64, 4 query heads a KV head) at 1/16 of its width, two layers
        return LlamaConfig(vocab_size=8016, hidden_size=128, intermediate_size=512,
                           num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                           head_dim=64, attn_implementation="sdpa")
    from loong_compile.estimate.presets import load_model

    spec = load_model(name)
    cls = Qwen2Config if spec.qkv_bias else LlamaConfig
    return cls(vocab_size=spec.vocab, hidden_size=spec.hidden, intermediate_size=spec.ffn,
               num_hidden_layers=spec.layers, num_attention_heads=spec.heads,
               num_key_value_heads=spec.kv_heads, head_dim=spec.head_dim or None,
               tie_word_embeddings=spec.tied_embeddings, max_position_embeddings=2 ** 22,
               attn_implementation="sdpa")


@dataclasses.dataclass
class Step:
    """One variant's training step on one device, compiled anew for each length."""

    variant: str
    config: object
    device: str
    cap_bytes: int | None
    tile_tokens: int | str = "auto"   # the "+tiles" variants' option

    def __post_init__(self):
        from transformers import AutoModelForCausalLM

        torch.manual_seed(0)
        dtype = torch.bfloat16 if self.device == "cuda" else torch.float32
        self.model = AutoModelForCausalLM.from_config(self.config, dtype=dtype).to(self.device)
        backend, checkpointing, options, _ = VARIANTS[self.variant]
        if self.variant.endswith("+tiles"):
            options = {**options, "tile_tokens": self.tile_tokens}
        if checkpointing:
            self.model.gradient_checkpointing_enable()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-5)
        self.backend, self.options = backend, options

    def run(self, tokens: int, steps: int = 1) -> dict | None:
        """``steps`` steps after the compiling one at ``tokens`` tokens: their seconds and peak,
        or None when one runs out of memory (or above the cap on CPU)."""
        torch._dynamo.reset()
        ids = torch.randint(0, self.config.vocab_size, (1, tokens), device=self.device)
        mask = torch.ones_like(ids)
        backend = self.backend
        if backend == "loong":
            import loong_compile as lc

            self.reports = []
            backend = lc.LoongBackend(self.options, on_report=self.reports.append)
        step = torch.compile(lambda i, m: self.model(i, attention_mask=m, labels=i).loss,
                             backend=backend, dynamic=False)
        try:
            self._train(step, ids, mask)
            rest, times = self._reset_peak(), []
            for _ in range(steps):
                start = time.perf_counter()
                self._train(step, ids, mask)
                times.append(time.perf_counter() - start)
            peak = self._peak(rest)
        except torch.cuda.OutOfMemoryError:
            return None
        finally:
            self.optimizer.zero_grad(set_to_none=True)
            if self.device == "cuda":
                torch.cuda.empty_cache()
        if self.cap_bytes is not None and self.device == "cpu" and peak["peak"] > self.cap_bytes:
            return None
        return {"tokens": tokens, "seconds": min(times), **peak, **self._attention()}

    def _attention(self) -> dict:
        """The attention calls the backend rewrote (their S x S masks dropped) and kept."""
        if self.backend != "loong":
            return {}
        records = [r.summary for report in {id(r): r for r in self.reports}.values()
                   for r in report.passes if r.name == "attention_2d"]
        return {"masks_dropped": sum(len(r["changed"]) for r in records),
                "masks_kept": sum(len(r["kept"]) for r in records)}

    def _train(self, step, ids, mask) -> None:
        step(ids, mask).backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.device == "cuda":
            torch.cuda.synchronize()

    def _reset_peak(self) -> int:
        if self.device == "cuda":
            torch.cuda.reset_peak_memory_stats()
            return torch.cuda.memory_allocated()
        rest = status_kib("VmRSS") * 1024
        Path("/proc/self/clear_refs").write_text("5")
        return rest

    def _peak(self, rest: int) -> dict:
        if self.device == "cuda":
            return {"peak": torch.cuda.max_memory_allocated() - rest,
                    "allocated": torch.cuda.max_memory_allocated(),
                    "reserved": torch.cuda.max_memory_reserved()}
        return {"peak": status_kib("VmHWM") * 1024 - rest}


def step_flops(config, tokens: int, causal: bool) -> float:
    """A training step's FLOPs: 6 per parameter and token for the matmuls (the LM head included,
    the embedding's lookup not) and 12·L·a·d·T² for attention's two products (half the pairs
    when causal)."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    width, layers = config.num_attention_heads * head_dim, config.num_hidden_layers
    kv = config.num_key_value_heads * head_dim
    per_layer = (2 * config.hidden_size * width + 2 * config.hidden_size * kv
                 + 3 * config.hidden_size * config.intermediate_size)
    matmul = layers * per_layer + config.hidden_size * config.vocab_size
    attention = 12 * layers * width * tokens ** 2 * (0.5 if causal else 1.0)
    return 6 * matmul * tokens + attention


def predicted(model: str, policy: str, hardware) -> int | None:
    """``loong plan --max-seq --gpus 1`` for ``policy`` (None for the tiny model or no GPU)."""
    if model.startswith("tiny") or hardware is None:
        return None
    from loong_compile.estimate.longest import longest_sequence
    from loong_compile.estimate.presets import load_model

    return longest_sequence(load_model(model), 1, hardware, policies=(policy,)).seq


def measure(args, variant: str, hardware) -> dict:
    step = Step(variant, model_config(args.model), args.device,
                None if args.cap_mib is None else args.cap_mib * 2 ** 20, args.tile_tokens)
    results: dict[int, dict | None] = {}

    def fits(tokens: int) -> bool:
        results[tokens] = step.run(tokens)
        print(json.dumps({"variant": variant, "tokens": tokens, "fits": results[tokens] is not None}),
              file=sys.stderr, flush=True)
        return results[tokens] is not None

    best = longest(fits, args.start, args.limit)
    row = {"variant": variant, "longest": best, "tried": sorted(results),
           "predicted": predicted(args.model, VARIANTS[variant][3], hardware)}
    if best:
        at = step.run(best, steps=2) or results[best]
        row.update({k: at[k] for k in ("masks_dropped", "masks_kept") if k in at})
        row.update(tokens_per_s=best / at["seconds"], peak_gib=at["peak"] / 2 ** 30,
                   **{k + "_gib": at[k] / 2 ** 30 for k in ("allocated", "reserved") if k in at})
        peak_tflops = args.peak_tflops or (hardware.peak_tflops if hardware else None)
        if peak_tflops:
            for causal in (True, False):
                flops = step_flops(step.config, best, causal)
                row["mfu_causal" if causal else "mfu"] = flops / at["seconds"] / (peak_tflops * 1e12)
    return row


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny", help="tiny, or a loong plan preset")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--start", type=int, default=1024, help="the first length (and the step)")
    parser.add_argument("--limit", type=int, default=2 ** 21, help="no length beyond it")
    parser.add_argument("--cap-mib", type=int, help="CPU: a step peaking above it fails")
    parser.add_argument("--cap-gib", type=float, help="CUDA: the process's memory cap")
    parser.add_argument("--tile-tokens", type=lambda v: v if v == "auto" else int(v),
                        default="auto", help='the "+tiles" variants\' tile_tokens ("auto" or tokens)')
    parser.add_argument("--hardware", help="the estimator's profile (h100, h200) for its prediction")
    parser.add_argument("--peak-tflops", type=float,
                        help="the device's dense bf16 peak for MFU (default: the profile's)")
    args = parser.parse_args(argv)
    if argv is None and args.device == "cpu" and "MALLOC_MMAP_THRESHOLD_" not in os.environ:
        # freed pages go back to the system, so that VmHWM measures each step's own peak
        os.execve(sys.executable, [sys.executable, *sys.argv],
                  {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"})
    if args.device == "cuda" and args.cap_gib:
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.cap_gib * 2 ** 30 / total))
    hardware = None
    if args.hardware:
        from loong_compile.estimate.hardware import load_hardware

        hardware = load_hardware(args.hardware)
    rows = [measure(args, variant, hardware) for variant in args.variants]
    for row in rows:
        print(json.dumps(row), flush=True)
    return rows


if __name__ == "__main__":
    main()
