"""The longest sequence a device trains, plain Inductor against ``backend="loong"`` (issues 36, 52).

    python benchmarks/longest_sequence.py --model llama3.2-1b --device cuda            # a GPU
    python benchmarks/longest_sequence.py --model tiny --cap-mib 48 --start 256        # CPU
    python benchmarks/longest_sequence.py --model tiny-1b --cap-mib 256 --start 1024 \
        --variants loong-sc++ "loong-sc++ +tiles" --tile-tokens 1024                     # tiling
    torchrun --nproc-per-node 4 benchmarks/longest_sequence.py --hp 2 --cp 2 --first 512 \
        --model tiny-1b --cap-mib 64 --variants loong-full+tiles alst --tile-tokens 512    # 4 ranks
    python benchmarks/longest_sequence.py --side-by-side ...   # issue 52: longest_side_by_side.py
    python benchmarks/longest_sequence.py --model tiny-1b --at 8192 16384 \
        --variants loong-sc++ "loong-sc++ +tiles" --tile-tokens 512 --lm-head-chunk 512  # peaks

The model is a ``loong plan`` preset (or ``tiny``: 2 layers, width 64, a 256-word vocabulary;
``tiny-1b``: Llama-3.2-1B's proportions at 1/16 of its width; ``--config`` overrides fields)
built with transformers from its shape, random weights, bf16 on CUDA (float32 on CPU), AdamW
with its states on the device.  A training step (``Step``) is ``model(ids,
position_ids=positions, labels=ids).loss`` on one row of random tokens (``--mask``: with a
collator's all-ones ``attention_mask``, from which transformers builds the S x S mask under
``torch.compile``), compiled, then
``backward()`` and the optimizer's step; on ``hp x cp`` ranks (under torchrun) each rank takes
its share of the row and of the loss.  ``alst`` is DeepSpeed's recipe (``alst.py``), eager.
For each variant, the longest length whose step completes: lengths double from ``--start``
until a step fails, then bisection between the last that passed and the first that failed
until they are within 1/16 of it (``longest``).  On CUDA a step fails by running out of memory
(caught, the cache emptied; ``--cap-gib`` caps the process below the device's memory); on CPU
by peaking above ``--cap-mib`` on any rank (``VmHWM`` above ``VmRSS`` over the step after the
compiling one, reset with ``/proc/self/clear_refs``; ``guard_memory`` keeps a step far past the
cap from taking the machine).  Each length compiles anew.  ``--at`` measures the peaks at given
lengths instead.

At the longest length of each variant: tokens/s of a step after the compiling one, MFU against
the device's bf16 peak with the attention's FLOPs counted causal (half the pairs) and
non-causal, the peak allocated and reserved (CUDA) or above rest (CPU), the first length's loss
(summed over the ranks: every variant's equals one process's), and ``loong plan --max-seq
--gpus 1`` for the same activation policy (the estimator's prediction; ``full`` for
transformers' gradient checkpointing and ALST).
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
    # token tiling (issue 52): the MLPs and the LM head with the loss a tile of --tile-tokens
    # at a time
    "loong-none+tiles": ("loong", False, {"activations": "none"}, "none"),
    "loong-sc++ +tiles": ("loong", False, {"activations": "sc++"}, "sc++"),
    "loong-full+tiles": ("loong", False, {"activations": "full"}, "full"),
    # DeepSpeed's ALST (benchmarks/alst.py), eager: Ulysses, TiledMLP, tiled loss, checkpointing
    "alst": ("alst", False, {}, "full"),
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


def model_config(name: str, overrides: list[str] = ()):
    """transformers' config of a preset's shape (Qwen2 for the presets with q/k/v biases), with
    ``overrides`` ("FIELD=INT", ``--config``) set on it."""
    config = _preset_config(name)
    for item in overrides:
        field, value = item.split("=")
        setattr(config, field, int(value))
    return config


def _preset_config(name: str):
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
    """One variant's training step on one device (or each rank's), compiled anew for each length.

    The batch is one row of random tokens, called as a collator without padding hands it over:
    ``model(ids, position_ids=positions, labels=ids).loss`` (no attention mask, so transformers
    runs SDPA causal, for every variant alike).  On ``hp x cp`` ranks ``loong`` gets this rank's
    tokens from ``shard_batch`` and ALST its contiguous piece (``alst.shard``); each rank's loss is
    its share of the row's, and the gradients are summed over the ranks before AdamW steps."""

    variant: str
    config: object
    device: str
    cap_bytes: int | None
    tile_tokens: int | str = "auto"   # the "+tiles" variants' option
    hp: int = 1
    cp: int = 1
    lm_head_chunk: int | None = None  # loong's option (default: the tile with tiles, else auto)
    mask: bool = False                # one process: a collator's all-ones attention_mask too
    head_groups: int = 1              # loong's option: attention a group of heads at a time

    def __post_init__(self):
        from transformers import AutoModelForCausalLM

        torch.manual_seed(0)
        dtype = torch.bfloat16 if self.device == "cuda" else torch.float32
        self.model = AutoModelForCausalLM.from_config(self.config, dtype=dtype).to(self.device)
        self.model.train()
        backend, checkpointing, options, _ = VARIANTS[self.variant]
        self.world = self.hp * self.cp
        if self.world > 1 and backend == "inductor":
            raise ValueError(f"{self.variant} holds the whole sequence on every rank (no sequence "
                             "parallelism): its longest on many ranks is its one-process one")
        if self.variant.endswith("+tiles"):   # the MLPs' tiles and the LM head's chunks alike
            options = {**options, "tile_tokens": self.tile_tokens,
                       "lm_head_chunk": self.tile_tokens}
        if backend == "loong":
            import loong_compile as lc

            self.mesh = lc.init_mesh(hp=self.hp, cp=self.cp)
            options = {**options, "hp": self.hp, "cp": self.cp}
            if self.lm_head_chunk is not None:
                options["lm_head_chunk"] = self.lm_head_chunk
            if self.head_groups > 1:
                options["head_groups"] = self.head_groups
        if backend == "alst":
            import alst

            alst.apply(self.model, self.world)
        if checkpointing:
            self.model.gradient_checkpointing_enable()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-5)
        self.backend, self.options = backend, options

    def run(self, tokens: int, steps: int = 1) -> dict | None:
        """``steps`` steps after the compiling one at ``tokens`` tokens: their seconds, the peak
        (the largest over the ranks) and the first step's loss (summed over the ranks), or None
        when one runs out of memory (or above the cap on CPU)."""
        torch._dynamo.reset()
        ids = torch.randint(0, self.config.vocab_size, (1, tokens),
                            generator=torch.Generator().manual_seed(tokens))
        step = self._compiled()
        batch = self._batch(ids)
        try:
            loss = self._train(step, batch)
            rest, times = self._reset_peak(), []
            for _ in range(steps):
                start = time.perf_counter()
                self._train(step, batch)
                times.append(time.perf_counter() - start)
            peak = self._peak(rest)
        except torch.cuda.OutOfMemoryError:
            return None
        finally:
            self.optimizer.zero_grad(set_to_none=True)
            if self.device == "cuda":
                torch.cuda.empty_cache()
        if self.world > 1:
            import torch.distributed as dist

            both = torch.tensor([float(peak["peak"]), loss])
            dist.all_reduce(both[:1], op=dist.ReduceOp.MAX)
            dist.all_reduce(both[1:])
            peak["peak"], loss = int(both[0]), float(both[1])
        if self.cap_bytes is not None and self.device == "cpu" and peak["peak"] > self.cap_bytes:
            return None
        return {"tokens": tokens, "seconds": min(times), "loss": loss, **peak, **self._attention()}

    def _compiled(self) -> Callable:
        """The step's loss function of the batch, compiled by the variant's backend."""
        if self.backend == "alst":
            import alst

            return lambda batch: alst.loss(self.model, **batch)
        backend = self.backend
        if backend == "loong":
            import loong_compile as lc

            self.reports = []
            backend = lc.LoongBackend(self.options, on_report=self.reports.append)
        return torch.compile(lambda batch: self.model(**batch).loss, backend=backend,
                             dynamic=False)

    def _batch(self, ids: torch.Tensor) -> dict:
        """This rank's inputs for the row ``ids`` (the whole row at one process)."""
        if self.backend == "alst":
            import alst

            batch = alst.shard(ids, self.world, self._rank())
        elif self.world > 1:
            import loong_compile as lc

            sharded = lc.shard_batch(ids, ids, self.mesh)
            batch = {"input_ids": sharded.input_ids, "position_ids": sharded.position_ids,
                     "labels": sharded.input_ids}
        else:
            batch = {"input_ids": ids, "position_ids": torch.arange(ids.shape[1])[None],
                     "labels": ids}
            if self.mask:   # transformers then builds the S x S mask under torch.compile
                batch["attention_mask"] = torch.ones_like(ids)
        return {k: v.to(self.device) if isinstance(v, torch.Tensor) else v
                for k, v in batch.items()}

    def _rank(self) -> int:
        import torch.distributed as dist

        return dist.get_rank() if dist.is_initialized() else 0

    def _attention(self) -> dict:
        """The attention calls the backend rewrote (their S x S masks dropped) and kept."""
        if self.backend != "loong":
            return {}
        records = [r.summary for report in {id(r): r for r in self.reports}.values()
                   for r in report.passes if r.name == "attention_2d"]
        return {"masks_dropped": sum(len(r["changed"]) for r in records),
                "masks_kept": sum(len(r["kept"]) for r in records)}

    def _train(self, step, batch: dict) -> float:
        loss = step(batch)
        loss.backward()
        if self.world > 1:
            self._reduce_gradients()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.device == "cuda":
            torch.cuda.synchronize()
        return loss.item()

    def _reduce_gradients(self) -> None:
        """Every gradient summed over the ranks of the sequence (each rank's loss is a share)."""
        if self.backend == "loong":
            import loong_compile as lc

            lc.reduce_gradients(self.model, self.mesh)
            return
        import torch.distributed as dist

        for parameter in self.model.parameters():
            if parameter.grad is not None:
                dist.all_reduce(parameter.grad)

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
    config = model_config(args.model, args.config)
    step = Step(variant, config, args.device,
                None if args.cap_mib is None else args.cap_mib * 2 ** 20, args.tile_tokens,
                args.hp, args.cp, args.lm_head_chunk, args.mask, args.head_groups)
    results: dict[int, dict | None] = {}
    lead = step._rank() == 0
    if args.at:   # no search: the peak at each length
        return {"variant": variant, "ranks": step.world, "peaks": [
            {"tokens": n, "peak_mib": (step.run(n) or {}).get("peak", 0) / 2 ** 20}
            for n in args.at]}

    def fits(tokens: int) -> bool:
        results[tokens] = step.run(tokens)
        if lead:
            print(json.dumps({"variant": variant, "ranks": step.world, "tokens": tokens,
                              "fits": results[tokens] is not None,
                              **(results[tokens] or {})}), file=sys.stderr, flush=True)
        return results[tokens] is not None

    best = longest(fits, args.start, args.limit)
    layout = (f"Ulysses over {step.world}" if step.backend == "alst" else
              f"hp={args.hp} x cp={args.cp}") if step.world > 1 else "one process"
    row = {"variant": variant, "ranks": step.world, "layout": layout, "longest": best, "tried": sorted(results),
           "predicted": predicted(args.model, VARIANTS[variant][3], hardware)}
    if best:
        at = results[best] if args.no_rerun else step.run(best, steps=2) or results[best]
        row.update({k: at[k] for k in ("masks_dropped", "masks_kept") if k in at})
        row.update(tokens_per_s=best / at["seconds"], peak_gib=at["peak"] / 2 ** 30,
                   **{k + "_gib": at[k] / 2 ** 30 for k in ("allocated", "reserved") if k in at})
        peak_tflops = args.peak_tflops or (hardware.peak_tflops if hardware else None)
        if peak_tflops:
            for causal in (True, False):
                flops = step_flops(step.config, best, causal)
                row["mfu_causal" if causal else "mfu"] = flops / at["seconds"] / (peak_tflops * 1e12)
    start = results.get(args.start)
    row["loss_at_start"] = start["loss"] if start else None
    return row


def guard_memory(limit_bytes: int) -> None:
    """Allocations past ``limit_bytes`` more than this process has now fail (``RLIMIT_DATA``)
    instead of swapping the machine out: a step doubling past the cap can grow by more than the
    cap (e.g. 32,768 tokens once took the VM's 24 GiB), and that failed step is above the cap
    anyway."""
    import resource

    now = status_kib("VmData") * 1024
    resource.setrlimit(resource.RLIMIT_DATA, (now + limit_bytes, resource.RLIM_INFINITY))


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny", help="tiny, or a loong plan preset")
    parser.add_argument("--config", nargs="+", default=[], metavar="FIELD=INT",
                        help="override fields of the model's config, e.g. num_key_value_heads=1")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--side-by-side", action="store_true",
                        help="the issue-52 table: SIDE_BY_SIDE's variants, one process and 4 ranks")
    parser.add_argument("--hp", type=int, default=1, help="head parallelism (under torchrun)")
    parser.add_argument("--cp", type=int, default=1, help="context parallelism (under torchrun)")
    parser.add_argument("--start", "--first", type=int, default=1024, dest="start",
                        help="the first length (and the step); --first under torchrun, which "
                             "takes --start for its --start-method")
    parser.add_argument("--limit", type=int, default=2 ** 21, help="no length beyond it")
    parser.add_argument("--cap-mib", type=int, help="CPU: a step peaking above it fails")
    parser.add_argument("--guard-gib", type=float, default=4.0,
                        help="CPU: allocations this far above the start fail (guard_memory)")
    parser.add_argument("--cap-gib", type=float, help="CUDA: the process's memory cap")
    parser.add_argument("--tile-tokens", type=lambda v: v if v == "auto" else int(v),
                        default="auto", help='the "+tiles" variants\' tile_tokens ("auto" or tokens)')
    parser.add_argument("--lm-head-chunk", type=int,
                        help="loong's lm_head_chunk (default: --tile-tokens with tiles, else auto)")
    parser.add_argument("--head-groups", type=int, default=1,
                        help="loong's head_groups (attention a group of heads at a time)")
    parser.add_argument("--mask", action="store_true",
                        help="one process: pass an all-ones attention_mask (a collator's batch)")
    parser.add_argument("--at", type=int, nargs="+",
                        help="no search: each variant's peak at these lengths (no cap)")
    parser.add_argument("--no-rerun", action="store_true",
                        help="time the search's step at the longest length (no second run)")
    parser.add_argument("--hardware", help="the estimator's profile (h100, h200) for its prediction")
    parser.add_argument("--peak-tflops", type=float,
                        help="the device's dense bf16 peak for MFU (default: the profile's)")
    args = parser.parse_args(argv)
    if args.side_by_side:
        from longest_side_by_side import side_by_side

        return side_by_side(sys.argv[1:] if argv is None else argv, args)
    if argv is None and args.device == "cpu" and "MALLOC_MMAP_THRESHOLD_" not in os.environ:
        # freed pages go back to the system, so that VmHWM measures each step's own peak
        os.execve(sys.executable, [sys.executable, *sys.argv],
                  {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"})
    if args.hp * args.cp > 1:
        import torch.distributed as dist

        dist.init_process_group("gloo")
    if args.device == "cpu":
        guard_memory(int(args.guard_gib * 2 ** 30))
    if args.device == "cuda" and args.cap_gib:
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.cap_gib * 2 ** 30 / total))
    hardware = None
    if args.hardware:
        from loong_compile.estimate.hardware import load_hardware

        hardware = load_hardware(args.hardware)
    rows = [measure(args, variant, hardware) for variant in args.variants]
    lead = not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0
    for row in rows if lead else []:
        print(json.dumps(row), flush=True)
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    return rows


if __name__ == "__main__":
    main()
