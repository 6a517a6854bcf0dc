"""Plots of a run's metrics.csv (matplotlib, headless)."""

from __future__ import annotations

import csv
from pathlib import Path


def read_metrics(path: Path) -> list[dict]:
    with Path(path).open() as f:
        return list(csv.DictReader(f))


def series(rows: list[dict], key: str) -> tuple[list[float], list[float]]:
    xs, ys = [], []
    for r in rows:
        v = r.get(key, "")
        if v not in ("", None):
            xs.append(float(r.get("step") or 0))
            ys.append(float(v))
    return xs, ys


def plot_metrics(metrics: Path, png: Path, title: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(metrics)
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.5))
    x, y = series(rows, "reward_mean")
    if x:
        axes[0].plot(x, y, lw=1)
    axes[0].set(title="reward (train rollouts)", xlabel="step")
    for key in sorted({k for r in rows for k in r if k.startswith(metric_name("pass@1/"))}):
        x, y = series(rows, key)
        axes[1].plot(x, y, marker="o", label=key.split("/", 1)[1])
    axes[1].set(title="greedy pass@1 per tier", xlabel="step", ylim=(-0.02, 1.02))
    axes[1].legend(title="tier", fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)
    return png


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
