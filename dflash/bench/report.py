"""Benchmark output: the terminal table, the Markdown tables and the PNG plots."""

from __future__ import annotations

from pathlib import Path

from dflash.bench.stats import Summary

COLUMNS = ("dataset", "method", "prompts", "tau", "tok/pass", "tok/s", "speedup", "paired", "vs loop-b1", "TTFT ms",
           "peak MB")


def _fmt(x, spec: str = ".2f", none: str = "-") -> str:
    return none if x is None else format(x, spec)


def summary_row(s: Summary) -> list[str]:
    return [s.dataset, s.method, str(s.prompts), _fmt(s.tau), _fmt(s.tokens_per_pass), _fmt(s.tokens_per_s, ".1f"),
            _fmt(s.speedup, ".2f") + ("x" if s.speedup is not None else ""), _fmt(s.speedup_paired_median),
            _fmt(s.speedup_vs_loop, ".2f") + ("x" if s.speedup_vs_loop is not None else ""),
            _fmt(s.ttft_ms, ".0f"), _fmt(s.peak_memory_mb, ".0f")]


def rich_table(summaries: list[Summary], title: str):
    from rich.table import Table

    table = Table(title=title, show_lines=False)
    for c in COLUMNS:
        table.add_column(c, justify="left" if c in ("dataset", "method") else "right")
    last = None
    for s in summaries:
        if last is not None and s.dataset != last:
            table.add_section()
        last = s.dataset
        table.add_row(*summary_row(s))
    return table


def markdown_table(summaries: list[Summary]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(summary_row(s)) + " |" for s in summaries]
    return "\n".join(lines) + "\n"


def markdown_machine(info: dict) -> str:
    """Where the figures were measured (bench.machine.machine_info), with the kernel table."""
    load = info.get("load_average")
    lines = [f"Machine: {info.get('cpu')}, {info.get('cpus')} CPUs, {info.get('threads')} torch threads, torch "
             f"{info.get('torch')}, load average at the end {load[0]:.2f}" if load else
             f"Machine: {info.get('cpu')}, {info.get('cpus')} CPUs, {info.get('threads')} torch threads"]
    kernels = info.get("kernels") or {}
    if kernels.get("shapes"):
        lines += ["", "Kernels (mode auto): " + "; ".join(
            f"{r['shape']} ({', '.join(r['roles'])}): " + " ".join(f"{b}:{k}" for b, k in zip(r["buckets"], r["kernels"]))
            for r in kernels["shapes"])]
    elif kernels:
        lines += ["", f"Kernels: {kernels.get('mode')}"]
    return "\n".join(lines) + "\n"


def markdown_sources(summaries: list[Summary]) -> str:
    """What each speculative method verified: tokens per verify pass with proposals (a tree's
    nodes + 1), the share of plain passes and of passes the draft model ran for (a hybrid tree
    runs it only while it pays), and the share of accepted proposals per source."""
    spec = [s for s in summaries if s.verified_per_step is not None]
    if not spec:
        return ""
    sources = sorted({k for s in spec for k in s.source_share})
    head = ["dataset", "method", "verified/pass", "plain passes", "draft passes"]
    head += [f"accepted from {k}" for k in sources]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for s in spec:
        cells = [_fmt(s.verified_per_step, ".1f"), _fmt(s.plain_share), _fmt(s.draft_share)]
        cells += [_fmt(s.source_share.get(k)) if s.source_share else "-" for k in sources]
        lines.append("| " + " | ".join([s.dataset, s.method] + cells) + " |")
    return "\n".join(lines) + "\n"


def markdown_positions(summaries: list[Summary]) -> str:
    """Per-position acceptance of the speculative methods, one row per dataset and method."""
    spec = [s for s in summaries if any(r is not None for r in s.position_acceptance)]
    if not spec:
        return ""
    width = max(len(s.position_acceptance) for s in spec)
    head = ["dataset", "method"] + [str(k) for k in range(1, width + 1)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for s in spec:
        cells = [_fmt(r) for r in s.position_acceptance] + [""] * (width - len(s.position_acceptance))
        lines.append("| " + " | ".join([s.dataset, s.method] + cells) + " |")
    return "\n".join(lines) + "\n"


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_histograms(summaries: list[Summary], path: Path) -> Path:
    """Acceptance-length histograms (share of steps), one panel per speculative method."""
    plt = _pyplot()
    spec = [s for s in summaries if s.dataset != "all" and sum(s.tau_histogram) and s.tau is not None]
    methods = list(dict.fromkeys(s.method for s in spec))
    fig, axes = plt.subplots(1, max(len(methods), 1), figsize=(5 * max(len(methods), 1), 3.6), squeeze=False)
    for ax, m in zip(axes[0], methods):
        rows = [s for s in spec if s.method == m]
        width = 0.8 / max(len(rows), 1)
        for j, s in enumerate(rows):
            total = sum(s.tau_histogram)
            xs = [i + 1 + (j - (len(rows) - 1) / 2) * width for i in range(len(s.tau_histogram))]
            ax.bar(xs, [c / total for c in s.tau_histogram], width, label=f"{s.dataset} (tau {s.tau:.2f})")
        ax.set(title=m, xlabel="tokens committed per step (acceptance length)", ylabel="share of steps")
        ax.legend(fontsize=7)
    return _save(fig, plt, path)


def plot_positions(summaries: list[Summary], path: Path) -> Path:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    for s in summaries:
        if s.dataset == "all" or not s.method.startswith("dflash"):
            continue
        ks = [k + 1 for k, r in enumerate(s.position_acceptance) if r is not None]
        ax.plot(ks, [r for r in s.position_acceptance if r is not None], marker="o", ms=3,
                label=f"{s.dataset} {s.method}")
    ax.set(xlabel="draft position k in the block", ylabel="P(position k accepted)", ylim=(0, 1.02),
           title="per-position acceptance")
    ax.legend(fontsize=7)
    return _save(fig, plt, path)


def plot_speedups(summaries: list[Summary], baseline: str, path: Path) -> Path:
    plt = _pyplot()
    rows = [s for s in summaries if s.method != baseline and s.speedup is not None]
    datasets = list(dict.fromkeys(s.dataset for s in rows))
    methods = list(dict.fromkeys(s.method for s in rows))
    fig, ax = plt.subplots(figsize=(max(6.0, 1.4 * len(datasets) * max(len(methods), 1) / 2), 3.8))
    width = 0.8 / max(len(methods), 1)
    for j, m in enumerate(methods):
        by = {s.dataset: s.speedup for s in rows if s.method == m}
        xs = [i + (j - (len(methods) - 1) / 2) * width for i in range(len(datasets))]
        ax.bar(xs, [by.get(d, 0.0) for d in datasets], width, label=m)
    ax.axhline(1.0, color="k", lw=0.8, ls="--")
    ax.set_xticks(range(len(datasets)), datasets)
    ax.set(ylabel=f"speedup over {baseline} (ratio of median tok/s)", title="speedup by dataset and method")
    ax.legend(fontsize=7)
    return _save(fig, plt, path)


def _save(fig, plt, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_plots(summaries: list[Summary], baseline: str, folder: Path) -> list[Path]:
    folder = Path(folder)
    return [plot_histograms(summaries, folder / "acceptance_histogram.png"),
            plot_positions(summaries, folder / "position_acceptance.png"),
            plot_speedups(summaries, baseline, folder / "speedup.png")]


# ---- `dflash profile` ----------------------------------------------------------------
STEP_PARTS = ("draft_forward", "draft_head", "verify_forward", "verify_head", "host")


OP_GROUPS = ("matmul", "attention", "layer", "other")  # bench/profile.py's grouping of a pass's ops


def _precision_lines(result: dict) -> list[str]:
    p = result.get("precision")
    if not p:
        return []
    where = f", weights from {p['source']}" + (f", {p['mb']} MB" if p.get("mb") is not None else "")
    return [f"Target precision: **{p['precision']}**{where}; resident memory after loading target and draft: "
            f"{result.get('rss_mb', '?')} MB.", ""]


def profile_markdown(result: dict) -> str:
    o = result["overhead"]
    m = result["machine"]
    cpu = f"{m['cpu']} ({m.get('cpus', '?')} cores), " if m.get("cpu") else ""
    lines = [f"Machine: {cpu}{m['threads']} torch threads, load average "
             f"{_load(result['machine'])}; clock: {result.get('clock', 'wall')}; draft: {result['draft']}.", "",
             *_precision_lines(result),
             f"**Engine overhead** (random draft, tau {o['tokens_per_step']:.2f}): one block-{o['block_size']} step "
             f"{o['block_step_ms']:.1f} ms vs one plain decode step {o['plain_step_ms']:.1f} ms: "
             f"**{o['ratio']:.2f}x** (a bare {o['block_size']}-token target forward: {o['bare_forward_ratio']:.2f}x).",
             "", "Step profile (median ms per step; host = step minus the timed parts):", "",
             "| block | tokens/step | step | draft forward | draft lm_head | verify forward | verify lm_head | host |",
             "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {s['block_size']} | {s['tokens_per_step']:.2f} | {s['step_ms']:.1f} | "
              + " | ".join(f"{s['parts_ms'][k]:.1f}" for k in STEP_PARTS)
              + " |" for s in [_as_step(o, "plain"), _as_step(o, "block")] + result["steps"]]
    lines[-len(result["steps"]) - 2] += "  (overhead check, plain)"
    lines[-len(result["steps"]) - 1] += "  (overhead check, random draft)"
    curve = result["target_curve"]
    lines += ["", "Verify pass, median ms for n query tokens (columns) after a context of c tokens (rows), and the "
              "ratio to n = 1: the target's layers plus its lm_head on row 0 (a step whose proposal 1 is rejected); "
              "below each, the lm_head on the other n - 1 rows, paid when proposal 1 is accepted:", "",
              "| context | " + " | ".join(str(n) for n in curve["ns"]) + " |", "|---|" + "---|" * len(curve["ns"])]
    for row in curve["rows"]:
        lines.append(f"| {row['context']} | " + " | ".join(f"{m:.0f} ({m / row['ms'][0]:.2f}x)" for m in row["ms"]) + " |")
        if "rest_head_ms" in row:
            lines.append("| + rows 2..n | " + " | ".join(f"{m:.0f}" for m in row["rest_head_ms"]) + " |")
    d = result["draft_curve"]
    lines += ["", f"Draft step ({d['draft_layers']} layers, context {d['context']}; lm_head and argmax included), "
              "median ms per block size:", "", "| block | " + " | ".join(str(b) for b in d["blocks"]) + " |",
              "|---|" + "---|" * len(d["blocks"]), "| ms | " + " | ".join(f"{m:.1f}" for m in d["ms"]) + " |"]
    h = result.get("head_cost")
    if h:
        lines += ["", f"The draft's lm_head + argmax over {h['positions']} proposals, full vocabulary vs its first K rows "
                  "(what a draft vocabulary would cost), median ms:", "",
                  "| vocabulary | " + " | ".join(str(v) for v in h["vocab"]) + " |", "|---|" + "---|" * len(h["vocab"]),
                  "| ms | " + " | ".join(f"{m:.1f}" for m in h["ms"]) + " |"]
    kernels = result.get("machine", {}).get("kernels")
    if kernels:
        lines += ["", kernel_markdown(kernels)]
    if result.get("by_kernels"):
        lines += ["", comparison_markdown(result["by_kernels"])]
    return "\n".join(lines) + "\n"


def kernel_markdown(info: dict) -> str:
    """The kernel table a TargetModel chose (`TargetModel.kernel_info()`): per weight shape
    the kernel at each token-count bucket, the copies held and what they cost."""
    if info.get("mode") != "auto":
        return f"Kernels: {info.get('mode', '?')} (the model's own modules).\n"
    shapes = info.get("shapes", [])
    if not shapes:
        return "Kernels: auto (no linear measured).\n"
    buckets = shapes[0]["buckets"]
    lines = [f"Kernels: auto, {info.get('measure_s', 0):.1f} s measuring at load"
             f"{' (the rest from the cache)' if info.get('cached') else ''}; the adapter's copies cost "
             f"{info.get('extra_mb', 0):.0f} MB.", "",
             "| shape (out x in) | used as | weights | " + " | ".join(f"n={b}" for b in buckets) + " | copies | MB |",
             "|---|---|---|" + "---|" * len(buckets) + "---|---|"]
    for r in shapes:
        cells = [r["kernels"][r["buckets"].index(b)] if b in r["buckets"] else "" for b in buckets]
        lines.append(f"| {r['shape']} | {', '.join(r['roles'])} | {r['weights']} | " + " | ".join(cells)
                     + f" | {', '.join(r['copies']) or '-'} | {r['extra_mb']:.1f} |")
    lines += ["", "Measured microseconds per product (" + " / ".join(shapes[0]["times_us"]) + "):", "",
              "| shape | " + " | ".join(f"n={b}" for b in buckets) + " |", "|---|" + "---|" * len(buckets)]
    for r in shapes:
        names = list(r["times_us"])
        cells = []
        for j, b in enumerate(buckets):
            if b not in r["buckets"]:
                cells.append("")
                continue
            k = r["buckets"].index(b)
            us = [r["times_us"][n][k] for n in names]
            cells.append(" / ".join("-" if t is None else f"{t:.0f}" for t in us))
        lines.append(f"| {r['shape']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def comparison_markdown(by_kernels: dict) -> str:
    """The figures each kernel setting changes, side by side: the overhead check, a decode
    step's op split, the verify curve's ratio to n = 1, the break-even tau per block size."""
    modes = list(by_kernels)
    if not modes:
        return ""
    lines = ["| figure | " + " | ".join(f"kernels={m}" for m in modes) + " |", "|---|" + "---|" * len(modes)]

    def row(name, fn):
        lines.append(f"| {name} | " + " | ".join(fn(by_kernels[m]) for m in modes) + " |")

    row("plain decode step (loop, ms)", lambda r: f"{r['overhead']['plain_step_ms']:.1f}")
    row(f"block-{by_kernels[modes[0]]['overhead']['block_size']} step, random draft (ms)",
        lambda r: f"{r['overhead']['block_step_ms']:.1f}")
    row("step ratio (block / plain)", lambda r: f"{r['overhead']['ratio']:.2f}x")
    row("decode step, profiled: matmul / attention / native layer / other ms",
        lambda r: " / ".join(f"{r['decode_ops']['groups_ms'].get(g, 0.0):.1f}" for g in OP_GROUPS))
    row("decode step: ops per step", lambda r: f"{r['decode_ops']['ops_per_step']:.0f}")
    row("adapter's extra weight copies (MB)", lambda r: f"{r['kernels'].get('extra_mb', 0):.0f}")
    from dflash.engine.costmodel import CostModel

    models = {m: CostModel.from_dict(r["cost_model"]["model"]) for m, r in by_kernels.items()}
    for n in (1, 2, 4, 8, 16, 32):
        lines.append(f"| T_t({n}): verify {n} tokens, ms (cost model) | "
                     + " | ".join(f"{models[m].verify_ms(n):.1f}" for m in modes) + " |")
    cm = by_kernels[modes[0]]["cost_model"]
    for b in cm["blocks"]:
        lines.append(f"| T_d({b}): draft step, block {b}, ms | " + " | ".join(f"{models[m].draft_ms(b):.1f}" for m in modes)
                     + " |")
    for j, b in enumerate(cm["blocks"]):
        row(f"verify {b} tokens / 1 token (cost model)", lambda r, j=j: f"{r['cost_model']['verify_ratio'][j]:.2f}x")
    for j, b in enumerate(cm["blocks"]):
        row(f"break-even tau, block {b}", lambda r, j=j: f"{r['cost_model']['break_even_tau'][j]:.2f}")
    out = ["Kernel settings side by side (the same model, machine and run):", "", *lines, ""]
    for m in modes:
        r = by_kernels[m]
        for ops in [r["decode_ops"]] + ([r["verify_ops"]] if "verify_ops" in r else []):
            what = "Decode step" if ops.get("tokens", 1) == 1 else f"{ops['tokens']}-token verify pass"
            out += [f"{what} ops with kernels={m} (context {ops['context']}; {ops['step_ms']:.1f} ms a pass outside "
                    f"the profiler, {ops['profiled_ms']:.1f} ms of op self time inside it; "
                    + ", ".join(f"{g} {ops['groups_ms'].get(g, 0.0):.1f}" for g in OP_GROUPS) + "), ms per pass:", "",
                    "| op | ms | calls |", "|---|---|---|"]
            out += [f"| {o['op']} | {o['ms']:.2f} | {o['calls']:.0f} |" for o in ops["ops"]]
            out.append("")
        if r.get("unfused_ops"):
            out += ["The same passes op by op (the layer not fused into one native call), ms per pass:", "",
                    "| tokens | pass | " + " | ".join(OP_GROUPS) + " |", "|---|---|" + "---|" * len(OP_GROUPS)]
            out += [f"| {o['tokens']} | {o['step_ms']:.1f} | " + " | ".join(f"{o['groups_ms'].get(g, 0.0):.1f}"
                                                                          for g in OP_GROUPS) + " |"
                    for o in r["unfused_ops"]]
            out.append("")
    return "\n".join(out)


def _as_step(o: dict, which: str) -> dict:
    return {"block_size": o["block_size"] if which == "block" else 1,
            "tokens_per_step": o["tokens_per_step"] if which == "block" else 1.0,
            "step_ms": o[f"{which}_step_ms"], "parts_ms": o[f"{which}_parts_ms"]}


def _load(machine: dict) -> str:
    load = machine.get("load_average")
    return "?" if not load else f"{load[0]:.1f}"


def plot_cost_curve(result: dict, path: Path) -> Path:
    plt = _pyplot()
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.8))
    curve = result["target_curve"]
    for row in curve["rows"]:
        a.plot(curve["ns"], [m / row["ms"][0] for m in row["ms"]], marker="o", ms=3, label=f"context {row['context']}")
    a.plot(curve["ns"], curve["ns"], color="grey", lw=0.8, ls=":", label="linear in n")
    a.set(xlabel="query tokens n", ylabel="forward time / time at n=1", title="target forward cost",
          ylim=(0, max(max(m / r["ms"][0] for m in r["ms"]) for r in curve["rows"]) * 1.15))
    a.legend(fontsize=7)
    d = result["draft_curve"]
    base = min(r["ms"][0] for r in curve["rows"])
    b.plot(d["blocks"], [m / base for m in d["ms"]], marker="o", ms=3)
    b.set(xlabel="block size", ylabel="draft step / target step at n=1",
          title=f"draft step cost ({d['draft_layers']} layers, context {d['context']})")
    return _save(fig, plt, path)


def markdown_block_choice(summaries: list[Summary], profile: dict, context: int = 512) -> str:
    """Predicted speedup per block size: each dataset's per-position acceptance (measured at
    its largest DFlash block) against the profile's cost curve at the context nearest `context`."""
    from dflash.bench.stats import expected_commits, predicted_speedup

    curve = profile["target_curve"]
    row = min(curve["rows"], key=lambda r: abs(r["context"] - context))
    target_ms = dict(zip(curve["ns"], row["ms"]))
    rest_ms = dict(zip(curve["ns"], row.get("rest_head_ms", [0.0] * len(curve["ns"]))))
    draft_ms = dict(zip(profile["draft_curve"]["blocks"], profile["draft_curve"]["ms"]))
    blocks = [b for b in curve["ns"] if b == 1 or b in draft_ms]
    best: dict[str, Summary] = {}
    for s in summaries:
        if s.method.startswith("dflash-b") and s.dataset != "all":
            if s.dataset not in best or len(s.position_acceptance) > len(best[s.dataset].position_acceptance):
                best[s.dataset] = s
    if not best:
        return ""
    lines = [f"Predicted speedup by block size (tau from per-position acceptance x cost curve at context "
             f"{row['context']}; host work left out):", "", "| dataset | " + " | ".join(f"b{b}" for b in blocks) + " |",
             "|---|" + "---|" * len(blocks)]
    for ds, s in best.items():
        cells = []
        for b in blocks:
            sp = (predicted_speedup(s.position_acceptance, b, target_ms, draft_ms, rest_ms)
                  if b <= len(s.position_acceptance) + 1 else None)
            cells.append("-" if sp is None else f"{sp:.2f}x (tau {expected_commits(s.position_acceptance, b):.2f})")
        lines.append(f"| {ds} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
