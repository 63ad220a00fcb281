"""The ``loong`` command: ``loong estimate`` (memory of one configuration) and ``loong plan``
(which configurations fit, ranked by predicted time; with ``--max-seq``, the longest sequence
that fits and the configurations that reach it).  Bad input exits with status 2 and a
message naming the value.  Runs without torch or a GPU.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Sequence

from loong_compile.errors import LoongConfigError, LoongError
from loong_compile.parallel.rules import ACTIVATION_POLICIES, ESTIMATED_POLICIES, PLACEMENTS

_SUFFIX = {"": 1, "k": 1024, "m": 1024 ** 2}
_SEQ_HELP = "sequence length (131072, 128K, 1M)"
_PLAN_WIDTH = 156   # the ranked table's natural width; narrower consoles would truncate its cells


def _positive_int(text: str) -> int:
    """An integer >= 1; ``128K`` = 131072 and ``1M`` = 1048576 (powers of two, as sequence lengths are)."""
    match = re.fullmatch(r"\s*(\d+)\s*([kKmM]?)\s*", text)
    value = int(match.group(1)) * _SUFFIX[match.group(2).lower()] if match else 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer (e.g. 8, 128K, 1M)")
    return value


def _number(low: float, high: float | None = None, low_open: bool = False):
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = float("nan")
        ok = value > low if low_open else value >= low
        if not (ok and (high is None or value <= high)):
            bound = f"{'>' if low_open else '>='} {low:g}" + (f" and <= {high:g}" if high is not None else "")
            raise argparse.ArgumentTypeError(f"{text!r} is not a number {bound}")
        return value
    return parse


def _choice_list(choices: Sequence[str]):
    def parse(text: str) -> tuple[str, ...]:
        items = tuple(x.strip() for x in text.split(",") if x.strip())
        bad = [x for x in items if x not in choices]
        if bad or not items:
            raise argparse.ArgumentTypeError(f"{text!r}: choose from {', '.join(choices)} (comma-separated)")
        return items
    return parse


def _list_of(parse_one):
    def parse(text: str) -> tuple:
        return tuple(parse_one(x) for x in text.split(","))
    return parse


def _chunk(text: str) -> int | str:
    return "auto" if text.strip() == "auto" else _positive_int(text)


def _zero_stage(text: str) -> int:
    if text.strip() not in ("0", "1", "2", "3"):
        raise argparse.ArgumentTypeError(f"{text!r} is not a ZeRO stage (0, 1, 2 or 3)")
    return int(text)


def _key_value(text: str) -> tuple[str, float]:
    key, sep, value = text.partition("=")
    if not sep:
        raise argparse.ArgumentTypeError(f"{text!r} is not key=value (e.g. nics_per_node=4)")
    return key.strip(), _number(0)(value)


def _add_common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True,
                        help="preset (llama2-7b, llama3.1-8b, llama3.1-70b, 7b-mha, 7b-gqa) or config.json path")
    parser.add_argument("--micro-batch", type=_positive_int, default=1, help="sequences per micro-batch")
    parser.add_argument("--gpu", help="hardware profile (a100, a100-40gb, h100, h100-94gb, h200) or JSON path")
    parser.add_argument("--gpu-opt", type=_key_value, action="append", default=[], metavar="KEY=VALUE",
                        help="override a hardware field, e.g. nics_per_node=4 (repeatable)")
    parser.add_argument("--capacity-gib", type=_number(0, low_open=True), help="GPU memory in GiB")
    parser.add_argument("--usable-fraction", type=_number(0, 1, low_open=True), default=0.8,
                        help="the paper's 80%% rule (default 0.8)")
    parser.add_argument("--dtype-bytes", type=int, choices=(1, 2, 4, 8), default=2)
    parser.add_argument("--cuda-context-gib", type=_number(0), help="overhead: CUDA context")
    parser.add_argument("--comm-buffers-gib", type=_number(0), help="overhead: communicator buffers")
    parser.add_argument("--fragmentation", type=_number(0), help="overhead: fraction of the estimate")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("--plot", metavar="PATH", help="write a chart (PNG, SVG, PDF) here")
    parser.add_argument("--window", type=_positive_int,
                        help="sliding window in tokens on every layer (replaces the model's)")
    parser.add_argument("--doc-length", type=_positive_int, default=0,
                        help="mean length of the packed documents (default: one per sequence)")
    parser.add_argument("--lm-head-chunk", type=_chunk, default="auto", metavar="TOKENS",
                        help="tokens per chunk of the LM head and its loss, as the compiler's "
                             "lm_head_chunk option (default: auto)")
    parser.add_argument("--unchunked-lm-head", action="store_true",
                        help="count the LM head's logits of every token (4D eq. 14: the logits "
                             "are a graph output, or the lm_head_loss pass is disabled)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="loong", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)

    est = commands.add_parser("estimate", help="per-GPU memory of one configuration")
    _add_common(est)
    est.add_argument("--seq", required=True, type=_positive_int, help=_SEQ_HELP)
    est.add_argument("--gpus", type=_positive_int, help="total GPUs (dp = gpus / (tp*pp*cp*hp))")
    for name in ("dp", "tp", "pp", "cp", "hp"):
        est.add_argument(f"--{name}", type=_positive_int, default=None if name == "dp" else 1)
    est.add_argument("--inner-ring", type=_positive_int, default=1)
    est.add_argument("--stage", type=int, default=0, help="pipeline stage (0 = first, the paper's)")
    est.add_argument("--zero", type=_zero_stage, default=1)
    est.add_argument("--activations", choices=ESTIMATED_POLICIES, default="none")
    est.add_argument("--alpha", type=_number(0, 1), default=1.0, help="memo: offloaded token fraction")
    est.add_argument("--exact", action="store_true", help="count lse and RMSNorm statistics too")
    est.add_argument("--double-ring-buffers", action="store_true", help="count the Double-Ring KV buffers")
    est.add_argument("--no-working-set", action="store_true", help="omit the recompute working set")

    pln = commands.add_parser("plan", help="rank the configurations that fit")
    _add_common(pln)
    length = pln.add_mutually_exclusive_group(required=True)
    length.add_argument("--seq", type=_positive_int, help=_SEQ_HELP)
    length.add_argument("--max-seq", action="store_true",
                        help="instead of --seq: find the longest sequence some configuration fits (per "
                             "dp x cp x hp mesh and overall, under every rule of plan) and rank the "
                             "configurations at that length")
    pln.add_argument("--seq-multiple", type=_positive_int, metavar="N",
                     help="with --max-seq: only lengths that are multiples of N (e.g. 1K); the layout's "
                          "own multiple (2*cp*hp, hp when cp = 1) always applies")
    pln.add_argument("--gpus", type=_positive_int, required=True, help="total GPUs")
    pln.add_argument("--activations", type=_choice_list(ACTIVATION_POLICIES),
                     default=ACTIVATION_POLICIES, help="policies to try (comma-separated)")
    pln.add_argument("--alphas", type=_list_of(_number(0, 1)), default=(0.0, 0.5, 1.0),
                     help="memo alphas to try (comma-separated)")
    pln.add_argument("--zero", type=_list_of(_zero_stage), default=(0, 1, 2, 3),
                     help="ZeRO stages to try over dp*cp*hp (default: all; FSDP2 runs 2 and 3)")
    pln.add_argument("--placements", type=_choice_list(PLACEMENTS), default=PLACEMENTS)
    pln.add_argument("--paper-terms", action="store_true",
                     help="the 4D paper's terms only (no lse / norm statistics / ring buffers / overheads)")
    pln.add_argument("--top", type=_positive_int, default=10, help="rows to show")
    pln.add_argument("--show-pruned", action="store_true", help="list every pruned configuration")
    pln.add_argument("--explain", type=_positive_int, metavar="N",
                     help="say why configuration N ranks where it does")
    return parser


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


def _memory_options(args, activations="none", alpha=1.0, zero=1, plan_defaults=False):
    from loong_compile.estimate.memory import MemoryOptions

    overrides = {name: getattr(args, name) for name in ("cuda_context_gib", "comm_buffers_gib", "fragmentation")
                 if getattr(args, name) is not None}
    chunk = None if args.unchunked_lm_head or getattr(args, "paper_terms", False) else args.lm_head_chunk
    common = dict(activations=activations, alpha=alpha, zero=zero, dtype_bytes=args.dtype_bytes,
                  usable_fraction=args.usable_fraction, lm_head_chunk=chunk, **overrides)
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
    options = _memory_options(args, args.activations, args.alpha, args.zero)
    result = estimate_memory(model, config, options, capacity)
    title = (f"{model.name}, seq {config.seq}, {config.gpus} GPUs (dp={config.dp} tp={config.tp} "
             f"pp={config.pp} cp={config.cp} hp={config.hp}), micro-batch {config.micro_batch}, "
             f"stage {config.stage}, activations={options.activations}, ZeRO-{options.zero}")
    if args.plot:
        from loong_compile.estimate.plot import plot_memory
        plot_memory(result, title, args.plot)
    if args.json:
        from loong_compile.estimate.memory import lm_head_chunk

        chunk = None if options.lm_head_chunk is None else lm_head_chunk(model, config, options)
        print(json.dumps({"model": model.as_dict(), "config": config.__dict__, "options": options.__dict__,
                          "lm_head_chunk_tokens": chunk, **result.to_dict()}, indent=2))
        return 0
    from rich.table import Table

    table = Table(title=title, title_justify="left")
    table.add_column("term")
    table.add_column("GiB", justify="right")
    table.add_column("source")
    for name, gib in result.terms.items():
        table.add_row(name, f"{gib:.2f}", result.sources[name])
    table.add_section()
    table.add_row("[bold]estimate[/bold]", f"[bold]{result.estimate_gib:.2f}[/bold]", "sum of the terms")
    table.add_section()
    for name, gib in result.overheads.items():
        table.add_row(f"overhead: {name}", f"{gib:.2f}", "MemoryOptions constant")
    table.add_row("total with overheads", f"{result.total_gib:.2f}", "")
    for name, gib in result.host.items():
        table.add_section()
        table.add_row(name, f"{gib:.2f}", result.sources[name] + " (host memory, not GPU)")
    console.print(table)
    if options.lm_head_chunk is not None:
        from loong_compile.estimate.memory import lm_head_chunk

        console.print(f"LM head: chunked with the loss in the graph, C = "
                      f"{lm_head_chunk(model, config, options)} tokens per chunk (lm_head_chunk="
                      f"{options.lm_head_chunk}); --unchunked-lm-head counts every token's logits "
                      "(4D eq. 14: logits returned by the compiled model)", highlight=False,
                      soft_wrap=True)
    color = {"fits": "green", "near limit": "yellow", "exceeds": "red"}[result.verdict]
    console.print(f"capacity {result.capacity_gib:g} GiB, usable {result.limit_gib:.2f} GiB "
                  f"({result.usable_fraction:g}), headroom {result.headroom_gib:.2f} GiB: "
                  f"[{color}]{result.verdict}[/{color}]")
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
                  memory_options=_memory_options(args, plan_defaults=True), doc_length=args.doc_length)
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
        _print_longest(longest, model, args.gpus, hardware, console)
        if result is None:
            return 0
    _print_plan(result, seq, args, published, explanation, console)
    return 0


def _print_longest(longest, model, gpus, hardware, console) -> None:
    from rich.table import Table

    table = Table(title=f"{model.name}, {gpus} x {hardware.name} ({hardware.memory_gib:g} GiB): the longest "
                        "sequence each mesh fits", title_justify="left")
    for column in ("dp", "cp", "hp", "lengths: multiples of", "longest", "with (least memory)", "GiB"):
        table.add_column(column, justify="left" if column.startswith("with") else "right", no_wrap=True)
    for m in longest.meshes:
        c = m.configuration
        with_ = "-" if c is None else (f"{c['activations']}" + (f" a={c['alpha']:g}" if c["activations"] == "memo"
                                                                  else "") + f", ZeRO-{c['zero']}")
        table.add_row(str(m.dp), str(m.cp), str(m.hp), f"{m.step:,}", f"{m.longest:,}" if m.longest else "none",
                      with_, "-" if m.estimate_gib is None else f"{m.estimate_gib:.2f}")
    console.print(table)
    if not longest.seq:
        console.print("[red]no configuration fits at any length[/red]: even the shortest length of each mesh "
                      "is over memory; see loong plan --seq N --show-pruned")
        return
    console.print(f"longest sequence that fits: [bold]{longest.seq:,}[/bold] tokens ({longest.seq / 1024:,.1f}K); "
                  "one step more on its mesh does not fit. The configurations at that length:")


def _print_plan(result, seq, args, published, explanation, console) -> None:
    from rich.table import Table

    hardware, model = result.hardware, result.model
    table = Table(title=f"{model.name}, seq {seq}, {args.gpus} x {hardware.name} "
                        f"({hardware.memory_gib:g} GiB): {len(result.ranked)} configurations fit, "
                        f"{len(result.pruned)} pruned", title_justify="left")
    for column in ("#", "dp", "cp", "hp", "placement", "ring", "activations", "ZeRO", "GiB",
                   "headroom", "attn ms/layer", "layer ms", "step s", "MFU", "tok/s/GPU"):
        table.add_column(column, justify="left" if column in ("placement", "activations") else "right",
                         no_wrap=True)
    for i, c in enumerate(result.ranked[:args.top], 1):
        policy = c.activations + (f" a={c.alpha:g}" if c.activations == "memo" else "")
        table.add_row(str(i), str(c.config.dp), str(c.config.cp), str(c.config.hp), c.placement,
                      str(c.config.inner_ring), policy, str(c.zero), f"{c.memory.estimate_gib:.1f}",
                      f"{c.memory.headroom_gib:.1f}", f"{c.cost.attention.total_s * 1e3:.2f}",
                      f"{c.cost.total_s * 1e3:.2f}", f"{c.step_s:.2f}", f"{c.mfu:.1%}",
                      f"{c.tokens_per_gpu_s:,.0f}")
    console.print(table)
    if result.best is None:
        console.print("[red]no configuration fits[/red]; pruned because:")
    else:
        console.print(f"recommended (#1; model states under ZeRO-{result.best.zero} over dp*cp*hp, "
                      f"micro-batch {args.micro_batch}; times are cost-model predictions):")
        console.print(f"  torch.compile(model, backend=\"loong\", options={result.best.options!r})",
                      highlight=False, soft_wrap=True)
        console.print(f"  launch: {result.best.launch()}", highlight=False, soft_wrap=True)
        line = f"predicted best MFU: {result.best.mfu:.2%}"
        if published is not None:
            line += f"; published: {published[1]}"
        console.print(line, highlight=False, soft_wrap=True)
        console.print("pruned:")
    for reason, count in sorted(result.pruned_reasons().items()):
        console.print(f"  {count:4d} x {reason}")
    if args.show_pruned:
        for p in result.pruned:
            console.print(f"  {p.config}: {p.reason}", highlight=False)
    console.print("searched: what torch.compile(backend=\"loong\") runs: dp x cp x hp meshes (tp = pp = 1), "
                  f"activations {', '.join(args.activations)}, ZeRO {', '.join(map(str, args.zero))} over "
                  "dp*cp*hp; tensor and pipeline parallelism: loong estimate --tp/--pp", highlight=False,
                  soft_wrap=True)
    for line in explanation or ():
        console.print(line, highlight=False, soft_wrap=True)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
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


if __name__ == "__main__":
    sys.exit(main())
