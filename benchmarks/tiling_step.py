"""Token tiling's cost in step time (issue 52): one process, the same model trained with plain
``backend="inductor"``, with ``backend="loong"`` and its MLPs tiled, and with ``loong`` untiled.

    nice -n 5 python benchmarks/tiling_step.py [--tokens 4096 16384] [--tile-tokens 1024] \
        [--rounds 9] [--call mask|plain] [--variants inductor loong+tiles loong] [--threads N] \
        [--config num_attention_heads=4 num_key_value_heads=1 head_dim=32]

The model is ``benchmarks/longest_sequence.py``'s ``tiny-1b`` (``--model``; imported, not
copied): transformers' Llama with Llama-3.2-1B's hidden : FFN : vocabulary at 1/16 of its width,
two layers, random weights, float32 on CPU, batch 1 (``--config`` overrides fields of its
config: ``tiny-1b`` has 2 query heads a KV head, Llama-3.2-1B 4; 4 heads of 32 and 1 KV head
keep its width).  Every variant gets its own copy of the
same initial weights and its own AdamW; a step is forward, backward and the optimizer's step:
``model(ids, attention_mask=mask, labels=ids).loss`` with ``mask`` all ones, an input of the
compiled function (``--call mask``: a collator's batch, as
``longest_sequence.py`` calls it; transformers builds the S x S mask under ``torch.compile``,
which ``loong`` drops) or ``model(ids, labels=ids).loss`` (``--call plain``: causal, no mask
for either backend), compiled with ``fullgraph=True, dynamic=False``, then ``backward()`` and
``AdamW.step()``.

Variants: ``inductor``; ``loong+tiles`` (the defaults and ``tile_tokens=--tile-tokens``: at
these sizes ``"auto"`` tiles nothing, its 1 GiB budget holds a whole MLP, so the tile is
forced); ``loong`` (``tile_tokens=0``).  For each length, every variant compiles and takes one
more step (warm-up), then ``--rounds`` interleaved rounds time one step of each variant, the
order reversed every other round, so that a shared machine's noise hits all alike.  Printed per
length and variant: the step's min / median / max over the rounds, the median ÷ plain
Inductor's, the first (compiling) step's loss (equal across variants up to round-off: the same
weights and tokens) and, for ``loong+tiles``, the tiled regions and their tiles from the
backend's report; then one JSON line with everything.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
import types

import torch
from longest_sequence import model_config

VARIANTS = {"inductor": ("inductor", None), "loong+tiles": ("loong", "tiles"),
            "loong": ("loong", 0)}


def _own_code(function, name: str):
    """``function`` with a code object of its own: Dynamo keeps compiled code per code object,
    so each variant (and length) gets its own entries instead of recompiling a shared one."""
    code = function.__code__.replace(co_name=name)
    return types.FunctionType(code, function.__globals__, name, None, function.__closure__)


class Variant:
    """One variant's model copy, optimizer and compiled loss, at one length at a time."""

    def __init__(self, name: str, model: torch.nn.Module, tile_tokens: int, call: str):
        import loong_compile as lc

        self.name, self.call = name, call
        self.model = copy.deepcopy(model)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-5)
        backend, tile = VARIANTS[name]
        self.reports: list = []
        if backend == "loong":
            backend = lc.LoongBackend({"tile_tokens": tile_tokens if tile == "tiles" else tile},
                                      on_report=self.reports.append)
        self.backend = backend

    def compile(self, tokens: int) -> None:
        self.reports.clear()
        model = self.model

        def loss(ids, mask):
            if mask is not None:
                return model(ids, attention_mask=mask, labels=ids).loss
            return model(ids, labels=ids).loss

        name = f"{self.name.replace('+', '_')}_{tokens}"
        self.loss = torch.compile(_own_code(loss, name), backend=self.backend, fullgraph=True,
                                  dynamic=False)

    def step(self, ids: torch.Tensor) -> tuple[float, float]:
        start = time.perf_counter()
        loss = self.loss(ids, torch.ones_like(ids) if self.call == "mask" else None)
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return time.perf_counter() - start, loss.item()

    def tiled(self) -> list[dict]:
        """The regions the tiling pass tiled (tokens, tile, tiles), from the backend's report."""
        records = [r.summary for report in {id(r): r for r in self.reports}.values()
                   for r in report.passes if r.name == "token_tiling"]
        return [{k: c[k] for k in ("module", "tokens", "tile", "tiles")}
                for s in records for c in s["changed"]]


def measure(variants: list[Variant], tokens: int, rounds: int, vocab: int) -> list[dict]:
    ids = torch.randint(0, vocab, (1, tokens), generator=torch.Generator().manual_seed(tokens))
    first = {}
    for v in variants:
        v.compile(tokens)
        first[v.name] = v.step(ids)
        v.step(ids)   # warm-up
    times: dict[str, list[float]] = {v.name: [] for v in variants}
    for r in range(rounds):
        for v in (variants if r % 2 == 0 else variants[::-1]):
            times[v.name].append(v.step(ids)[0])
        print(json.dumps({"tokens": tokens, "round": r + 1,
                          **{k: round(t[-1], 4) for k, t in times.items()}}),
              file=sys.stderr, flush=True)
    base = statistics.median(times["inductor"]) if "inductor" in times else None
    rows = []
    for v in variants:
        t = times[v.name]
        rows.append({"tokens": tokens, "variant": v.name, "min_s": min(t),
                     "median_s": statistics.median(t), "max_s": max(t),
                     "vs_inductor": statistics.median(t) / base if base else None,
                     "first_step_s": first[v.name][0], "first_loss": first[v.name][1],
                     "tiled": v.tiled() if v.backend != "inductor" else None, "times": t})
    return rows


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-1b", help="longest_sequence.py's model_config name")
    parser.add_argument("--tokens", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--tile-tokens", type=int, default=1024, help="loong+tiles' tile_tokens")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--call", default="mask", choices=["mask", "plain"])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--threads", type=int, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--config", nargs="+", default=[], metavar="FIELD=INT",
                        help="override fields of the model's config, e.g. num_key_value_heads=1")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM

    config = model_config(args.model, args.config)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    variants = [Variant(name, model, args.tile_tokens, args.call) for name in args.variants]
    print(f"{args.model}: hidden {config.hidden_size}, FFN {config.intermediate_size}, "
          f"{config.num_attention_heads} heads / {config.num_key_value_heads} KV, vocabulary "
          f"{config.vocab_size}, {config.num_hidden_layers} layers, float32, batch 1, call "
          f"{args.call!r}; forward + backward + AdamW; {torch.get_num_threads()} threads; "
          f"loong+tiles: tile_tokens={args.tile_tokens}; {args.rounds} interleaved rounds")
    print(f"{'tokens':>7} {'variant':>12} {'min s':>7} {'median s':>9} {'max s':>7} "
          f"{'÷ inductor':>10} {'first s':>8} {'loss':>9}  tiled regions", flush=True)
    rows = []
    for tokens in args.tokens:
        for row in measure(variants, tokens, args.rounds, config.vocab_size):
            ratio = f"{row['vs_inductor']:9.3f}x" if row["vs_inductor"] else f"{'':>10}"
            tiled = (f"{len(row['tiled'])} x {row['tiled'][0]['tiles']} tiles of "
                     f"{row['tiled'][0]['tile']}" if row["tiled"] else "")
            print(f"{tokens:7d} {row['variant']:>12} {row['min_s']:7.3f} {row['median_s']:9.3f} "
                  f"{row['max_s']:7.3f} {ratio} {row['first_step_s']:8.1f} "
                  f"{row['first_loss']:9.6f}  {tiled}", flush=True)
            rows.append(row)
    print(json.dumps(rows))
    return rows


if __name__ == "__main__":
    main()
