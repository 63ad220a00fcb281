"""The ``loong`` command's arguments: the parser of ``loong estimate`` and ``loong plan``, and
value types that refuse a bad value by name (argparse prints the usage and exits with status 2).
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Sequence

from loong_compile.parallel.rules import ACTIVATION_POLICIES, ESTIMATED_POLICIES, PLACEMENTS

_SUFFIX = {"": 1, "k": 1024, "m": 1024 ** 2}
_SEQ_HELP = "sequence length (131072, 128K, 1M)"


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
    parser.add_argument("--untiled-mlp", action="store_true",
                        help="count every MLP intermediate (tile_tokens=0, or the MLP under "
                             "autocast); default: tiled as the compiler's tile_tokens='auto'")


def build_parser(description: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="loong", description=description)
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
    est.add_argument("--states-on-host", action="store_true",
                     help="with --zero 3: the shards on the host, the device holding what FSDP2 gathers "
                          "(examples/training.py --fsdp --offload-states)")
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
    pln.add_argument("--no-states-on-host", action="store_true",
                     help="do not also try ZeRO-3 with the states on the host (--fsdp --offload-states)")
    pln.add_argument("--placements", type=_choice_list(PLACEMENTS), default=PLACEMENTS)
    pln.add_argument("--paper-terms", action="store_true",
                     help="the 4D paper's terms only (no lse / norm statistics / ring buffers / overheads)")
    pln.add_argument("--top", type=_positive_int, default=10, help="rows to show")
    pln.add_argument("--show-pruned", action="store_true", help="list every pruned configuration")
    pln.add_argument("--explain", type=_positive_int, metavar="N",
                     help="say why configuration N ranks where it does")
    return parser

