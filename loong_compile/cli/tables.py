"""What ``loong estimate`` and ``loong plan`` print to a console: the estimate's terms, the
longest sequence each mesh fits and the ranked configurations (Rich tables), each followed by
what it concludes.
"""

from __future__ import annotations

from rich.table import Table


def print_estimate(result, title, model, config, options, console) -> None:
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
    if result.host:
        table.add_section()
    for name, gib in result.host.items():
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


def print_longest(longest, model, gpus, hardware, console) -> None:
    from loong_compile.estimate.search import model_states_label

    table = Table(title=f"{model.name}, {gpus} x {hardware.name} ({hardware.memory_gib:g} GiB): the longest "
                        "sequence each mesh fits", title_justify="left")
    for column in ("dp", "cp", "hp", "lengths: multiples of", "longest", "with (least memory)", "GiB",
                   "host GiB/node"):
        table.add_column(column, justify="left" if column.startswith("with") else "right", no_wrap=True)
    node_gpus = hardware.gpus_in_node(gpus)
    for m in longest.meshes:
        c = m.configuration
        with_ = "-" if c is None else (policy_label(c["activations"], c["alpha"], c["head_groups"])
                                       + f", {model_states_label(c['zero'], c['states_on_host'])}")
        table.add_row(str(m.dp), str(m.cp), str(m.hp), f"{m.step:,}", f"{m.longest:,}" if m.longest else "none",
                      with_, "-" if m.estimate_gib is None else f"{m.estimate_gib:.2f}",
                      "-" if m.host_gib is None else f"{node_gpus * m.host_gib:.1f}")
    console.print(table)
    if not longest.seq:
        console.print("[red]no configuration fits at any length[/red]: even the shortest length of each mesh "
                      "is over memory; see loong plan --seq N --show-pruned")
        return
    console.print(f"longest sequence that fits: [bold]{longest.seq:,}[/bold] tokens ({longest.seq / 1024:,.1f}K); "
                  "one step more on its mesh does not fit. The configurations at that length:")


def policy_label(activations: str, alpha: float, head_groups: int) -> str:
    """How both tables name a configuration's policy: ``"memo a=0, head groups 4"``."""
    return (activations + (f" a={alpha:g}" if activations == "memo" else "")
            + (f", head groups {head_groups}" if head_groups > 1 else ""))


def print_plan(result, seq, args, published, explanation, console) -> None:
    hardware, model = result.hardware, result.model
    table = Table(title=f"{model.name}, seq {seq}, {args.gpus} x {hardware.name} "
                        f"({hardware.memory_gib:g} GiB): {len(result.ranked)} configurations fit, "
                        f"{len(result.pruned)} pruned", title_justify="left")
    for column in ("#", "dp", "cp", "hp", "placement", "ring", "activations", "ZeRO", "GiB",
                   "headroom", "attn ms/layer", "layer ms", "step s", "MFU", "tok/s/GPU"):
        table.add_column(column, justify="left" if column in ("placement", "activations") else "right",
                         no_wrap=True)
    for i, c in enumerate(result.ranked[:args.top], 1):
        policy = policy_label(c.activations, c.alpha, c.config.head_groups)
        table.add_row(str(i), str(c.config.dp), str(c.config.cp), str(c.config.hp), c.placement,
                      str(c.config.inner_ring), policy, c.model_states.removeprefix("ZeRO-"),
                      f"{c.memory.estimate_gib:.1f}",
                      f"{c.memory.headroom_gib:.1f}", f"{c.cost.attention.total_s * 1e3:.2f}",
                      f"{c.cost.total_s * 1e3:.2f}", f"{c.step_s:.2f}", f"{c.mfu:.1%}",
                      f"{c.tokens_per_gpu_s:,.0f}")
    console.print(table)
    if result.best is None:
        console.print("[red]no configuration fits[/red]; pruned because:")
    else:
        best = result.best
        host = (f", {hardware.gpus_in_node(args.gpus) * best.memory.host_gib:.1f} GiB of host memory per node"
                if best.memory.host_gib else "")
        console.print(f"recommended (#1; model states under {best.model_states} over dp*cp*hp{host}, "
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
                  "dp*cp*hp" + ("" if args.no_states_on_host or 3 not in args.zero else
                                " (ZeRO-3 also with the states on the host)")
                  + "; tensor and pipeline parallelism: loong estimate --tp/--pp", highlight=False,
                  soft_wrap=True)
    for line in explanation or ():
        console.print(line, highlight=False, soft_wrap=True)

