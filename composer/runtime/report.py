"""Plots of a run's metrics.csv (matplotlib, headless)."""

from __future__ import annotations

import csv
from pathlib import Path


def read_metrics(path: Path) -> list[dict]:
    with Path(path).open(encoding="utf-8", errors="replace", newline="") as f:
        try:
            return [r for r in csv.DictReader(f) if isinstance(r, dict)]
        except csv.Error:
            return []


def series(rows: list[dict], key: str) -> tuple[list[float], list[float]]:
    xs, ys = [], []
    for r in rows:
        v = r.get(key, "")
        if v not in ("", None):
            try:  # an edited or damaged cell is left out of the plot, not the end of the run
                x, y = float(r.get("step") or 0), float(v)
            except (TypeError, ValueError):
                continue
            xs.append(x)
            ys.append(y)
    return xs, ys


def plot_metrics(metrics: Path, png: Path, title: str) -> Path:
    """Three panels against step: the loss (and each term's, with several terms), the training reward (and
    each reward source's, `source_reward/<source>`), and evaluation (greedy pass@1 per tier, pass@k when sampled).
    A panel with nothing measured says so (an SFT run has no reward)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(metrics)
    keys = sorted({k for r in rows for k, v in r.items() if v not in ("", None)})
    fig, axes = plt.subplots(1, 3, figsize=(15, 3.6))
    panels = [
        (axes[0], "loss", ["loss"] + [k for k in keys if k.endswith("/loss")], None),
        (axes[1], "reward (train rollouts)", [k for k in ["reward_mean"] + [k for k in keys if k.startswith("source_reward/")]
                                              if k in keys], None),
        (axes[2], "evaluation", [k for k in keys if k.startswith(metric_name("pass@"))], (-0.02, 1.02)),
    ]
    for ax, name, series_keys, ylim in panels:
        drawn = 0
        for key in series_keys:
            x, y = series(rows, key)
            if x:
                ax.plot(x, y, lw=1, marker="o" if len(x) < 20 else None, ms=3, label=key)
                drawn += 1
        ax.set(title=name, xlabel="step", **({"ylim": ylim} if ylim else {}))
        if drawn:
            ax.legend(fontsize=7)
        else:
            ax.text(0.5, 0.5, "not measured in this run", ha="center", va="center", transform=ax.transAxes,
                    fontsize=9, color="gray")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)
    return png


def plotted_keys(metrics: Path) -> dict[str, list[str]]:
    """The metrics.csv columns each panel of `plot_metrics` draws (for report.md and tests)."""
    rows = read_metrics(metrics)
    keys = sorted({k for r in rows for k, v in r.items() if v not in ("", None)})
    return {"loss": [k for k in ["loss"] + [k for k in keys if k.endswith("/loss")] if k in keys],
            "reward": [k for k in ["reward_mean"] + [k for k in keys if k.startswith("source_reward/")] if k in keys],
            "evaluation": [k for k in keys if k.startswith(metric_name("pass@"))]}


def evaluation_table(metrics: Path) -> list[str]:
    """Every evaluation of the run (metrics.csv's `pass_at_*` columns), as markdown table lines: one row per
    evaluated step, oldest first (the final evaluation's row is the run's step count), one column per metric
    and tier, named as the run logs them with `@` (`pass@1/tier6`); [] when the run never evaluated. A damaged
    cell shows as `-`."""
    rows = read_metrics(metrics)
    keys = plotted_keys(metrics)["evaluation"]
    by_step: dict[float, dict] = {}
    for r in rows:
        vals = {k: r[k] for k in keys if r.get(k) not in ("", None)}
        try:
            step = float(r.get("step") or 0)
        except (TypeError, ValueError):
            continue
        if vals:
            by_step.setdefault(step, {}).update(vals)
    if not by_step:
        return []
    lines = ["| step | " + " | ".join(k.replace("_at_", "@") for k in keys) + " |",
             "| --- |" + " --- |" * len(keys)]
    for step in sorted(by_step):
        lines.append(f"| {step:g} | " + " | ".join(_cell(by_step[step].get(k)) for k in keys) + " |")
    return lines


def _cell(value) -> str:
    try:
        return f"{float(value):.3f}"
    except (TypeError, ValueError):
        return "-"


def metric_name(name: str) -> str:
    """The one name a metric has in every logger (metrics.csv, TensorBoard, W&B, MLflow): MLflow accepts
    letters, digits and `_ / . - space` only, so `@` is written `_at_` (`pass@1/tier6` -> `pass_at_1/tier6`)
    and any other character outside that set `_`. Names are also paths in MLflow's file store: no metric
    is logged under a name that is the folder of another (the run logs `pass_at_1/<tier>`, never a bare
    `pass_at_1`)."""
    import re

    return re.sub(r"[^A-Za-z0-9_/. -]", "_", name.replace("@", "_at_"))


def metric_row(values: dict) -> dict:
    """`values` with every key as `metric_name` writes it."""
    return {metric_name(k): v for k, v in values.items()}
