"""The ``loong`` command: ``loong estimate`` (memory of one configuration) and ``loong plan``
(which configurations fit, ranked by predicted time; with ``--max-seq``, the longest sequence
that fits and the configurations that reach it).  Bad input exits with status 2 and a
message naming the value.  Runs without torch or a GPU.

Here: what each command computes and prints as JSON; its arguments are ``parser.py``'s,
its tables ``tables.py``'s.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence

from loong_compile.cli.parser import build_parser
from loong_compile.cli.tables import print_estimate, print_longest, print_plan
from loong_compile.errors import LoongConfigError, LoongError

_PLAN_WIDTH = 156   # the ranked table's natural width; narrower consoles would truncate its cells


def _hardware(args, required: bool):
    from loong_compile.estimate.hardware import load_hardware

    if args.gpu is None:
        if required or args.gpu_opt:
            rule = ("plan needs a hardware profile" if required
                    else "--gpu-opt overrides fields of the --gpu profile")
            raise LoongConfigError("hardware missing: no --gpu given", rule,
                                   "pass --gpu h100 (or a100, h200, a JSON profile)")
        return None
    return load_hardware(args.gpu, **dict(args.gpu_opt))


def _memory_options(args, activations="none", alpha=1.0, zero=1, states_on_host=False, plan_defaults=False):
    from loong_compile.estimate.memory import MemoryOptions

    overrides = {name: getattr(args, name) for name in ("cuda_context_gib", "comm_buffers_gib", "fragmentation")
                 if getattr(args, name) is not None}
    paper = getattr(args, "paper_terms", False)
    chunk = None if args.unchunked_lm_head or paper else args.lm_head_chunk
    tile = None if args.untiled_mlp or paper else "auto"
    common = dict(activations=activations, alpha=alpha, zero=zero, states_on_host=states_on_host,
                  dtype_bytes=args.dtype_bytes, usable_fraction=args.usable_fraction, lm_head_chunk=chunk,
                  tile_tokens=tile, **overrides)
    if plan_defaults:
        return MemoryOptions(**common) if args.paper_terms else MemoryOptions.loongtrain(**common)
    return MemoryOptions(exact=args.exact, double_ring_buffers=args.double_ring_buffers,
                         recompute_working_set=not args.no_working_set, **common)


def _masked_model(model, args):
    """The model with ``--window`` on every layer."""
    import dataclasses

    if args.window:
        model = dataclasses.replace(model, sliding_window=args.window, local_layers=model.layers)
    return model


def _say_masks(args, seq, console):
    """What the masks are assumed to be (memory is unchanged by them: the masks' ids are a few
    integers per token)."""
    from loong_compile.estimate.masking import describe

    if (args.window or args.doc_length) and not args.json:
        console.print(describe(args.window, args.doc_length, seq, getattr(args, "cp", None))
                      + "; memory unchanged")


def run_estimate(args, console) -> int:
    from loong_compile.estimate.memory import ParallelConfig, estimate_memory
    from loong_compile.estimate.presets import load_model
    from loong_compile.estimate.search import model_states_label

    model = _masked_model(load_model(args.model), args)
    _say_masks(args, args.seq, console)
    hardware = _hardware(args, required=False)
    capacity = args.capacity_gib if args.capacity_gib is not None else (hardware and hardware.memory_gib)
    if capacity is None:
        raise LoongConfigError("capacity missing: neither --gpu nor --capacity-gib given",
                               "the estimate is judged against the GPU's memory",
                               "pass --gpu h100 or --capacity-gib 80")
    product = args.tp * args.pp * args.cp * args.hp
    dp = args.dp
    if args.gpus is not None:
        if args.gpus % product:
            raise LoongConfigError(f"--gpus {args.gpus}", f"gpus must be a multiple of tp*pp*cp*hp = {product}",
                                   "change --gpus or the parallel sizes")
        if dp is not None and dp * product != args.gpus:
            raise LoongConfigError(f"--dp {dp} with --gpus {args.gpus}", "dp*tp*pp*cp*hp must equal gpus",
                                   "give --gpus or --dp, not both, or make them agree")
        dp = args.gpus // product
    config = ParallelConfig(seq=args.seq, dp=dp or 1, tp=args.tp, pp=args.pp, cp=args.cp, hp=args.hp,
                            micro_batch=args.micro_batch, inner_ring=args.inner_ring, stage=args.stage,
                            doc_length=args.doc_length)
    options = _memory_options(args, args.activations, args.alpha, args.zero, args.states_on_host)
    result = estimate_memory(model, config, options, capacity)
    title = (f"{model.name}, seq {config.seq}, {config.gpus} GPUs (dp={config.dp} tp={config.tp} "
             f"pp={config.pp} cp={config.cp} hp={config.hp}), micro-batch {config.micro_batch}, "
             f"stage {config.stage}, activations={options.activations}, "
             f"{model_states_label(options.zero, options.states_on_host)}")
    if args.plot:
        from loong_compile.estimate.plot import plot_memory
        plot_memory(result, title, args.plot)
    if args.json:
        from loong_compile.estimate.memory import lm_head_chunk

        chunk = None if options.lm_head_chunk is None else lm_head_chunk(model, config, options)
        print(json.dumps({"model": model.as_dict(), "config": config.__dict__, "options": options.__dict__,
                          "lm_head_chunk_tokens": chunk, **result.to_dict()}, indent=2))
        return 0
    print_estimate(result, title, model, config, options, console)
    return 0


def run_plan(args, console) -> int:
    from loong_compile.estimate.presets import load_model
    from loong_compile.estimate.rationale import explain_rank
    from loong_compile.estimate.validation import published_reference

    if args.seq_multiple is not None and not args.max_seq:
        raise LoongConfigError(f"--seq-multiple {args.seq_multiple} with --seq {args.seq}",
                               "--seq-multiple rounds the lengths --max-seq tries",
                               "pass --max-seq instead of --seq, or drop --seq-multiple")
    model = _masked_model(load_model(args.model), args)
    hardware = _hardware(args, required=True)
    if args.capacity_gib is not None:
        import dataclasses
        hardware = dataclasses.replace(hardware, memory_gib=args.capacity_gib)
    search = dict(policies=args.activations, alphas=args.alphas, zero_stages=args.zero,
                  micro_batch=args.micro_batch, placements=args.placements,
                  memory_options=_memory_options(args, plan_defaults=True), doc_length=args.doc_length,
                  states_on_host=not args.no_states_on_host)
    if args.max_seq:
        from loong_compile.estimate.longest import longest_sequence
        longest = longest_sequence(model, args.gpus, hardware, seq_multiple=args.seq_multiple or 1, **search)
        seq, result = longest.seq, longest.plan
    else:
        from loong_compile.estimate.search import plan
        longest, seq = None, args.seq
        result = plan(model, seq, args.gpus, hardware, **search)
    if seq:
        _say_masks(args, seq, console)
    if args.plot and result is not None:
        from loong_compile.estimate.plot import plot_plan
        plot_plan(result, args.plot, args.top)
    published = published_reference(model, seq, args.gpus) if seq else None
    explanation = explain_rank(result, args.explain) if args.explain and result is not None else None
    if args.json:
        out = longest.to_dict(top=args.top) if longest else result.to_dict(top=args.top)
        out["published"] = None if published is None else {"mfu": published[0], "source": published[1]}
        if explanation:
            out["explain"] = {"rank": args.explain, "lines": explanation}
        print(json.dumps(out, indent=2))
        return 0
    if longest is not None:
        print_longest(longest, model, args.gpus, hardware, console)
        if result is None:
            return 0
    print_plan(result, seq, args, published, explanation, console)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser(__doc__.split("\n\n")[0])
    args = parser.parse_args(argv)     # bad syntax or values: argparse prints usage, exits 2
    from rich.console import Console

    console = Console()
    if args.command == "plan" and console.width < _PLAN_WIDTH:
        console = Console(width=_PLAN_WIDTH)
    try:
        return {"estimate": run_estimate, "plan": run_plan}[args.command](args, console)
    except LoongError as exc:
        print(f"loong {args.command}: error: {exc}", file=sys.stderr)
        return 2
