"""`composer bench`: methods side by side on the toy testbed at an equal budget of policy samples.

Each (spec, sweep value, seed) is an ordinary run; the bench only chooses its length so that every
method sees the same number of policy-generated samples, then evaluates the final policy the same
way for all: greedy pass@1 per tier and unbiased pass@k from sampled answers. The judge's and the
teacher's inference are reported as separate cost columns, for compute-matched reading.

The default settings below were fixed before any method was compared, and are written into summary.md.
"""

from __future__ import annotations

import csv
import json
import math
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

DEFAULTS = {
    "budget_samples": 4096,  # policy-generated samples per run (SFT: demonstrations)
    "seeds": 2,
    "eval_samples": 32,  # held-out problems per tier for greedy pass@1
    "pass_k_n": 32,  # samples per problem for pass@k (k = 1..32)
    "pass_k_problems": 16,
    "eval_every": 10,
}
QUICK = {"budget_samples": 256, "seeds": 1, "eval_samples": 8, "pass_k_n": 4, "pass_k_problems": 4, "eval_every": 2}
MIDDLE, HARD = "tier6", "tier8"  # the student solves tiers 1-4 at the start (bootstrap), so 6 is the middle

SUITE = {  # study -> list of (label, spec, overrides)
    "methods": [(m, f"specs/{m}.yaml", []) for m in
                ("sft", "grpo", "opd", "opsd", "sdpo", "pope", "int", "oapl", "mintrl")],
    "coverage": [("grpo", "specs/grpo.yaml", []), ("mintrl", "specs/mintrl.yaml", []),
                 ("int", "specs/int.yaml", []), ("pope", "specs/pope.yaml", [])],
    "intensity": [(f"mintrl max_reviews={r}", "specs/mintrl.yaml", [f"rollout.guide.max_reviews={r}"])
                  for r in (0, 1, 2, 4, 8)],
    "lag": [(f"{m} sync.every={L}", f"specs/{m}.yaml", [f"sync.every={L}", "sync.off_policy_ok=true"])
            for m in ("oapl", "grpo") for L in (1, 10, 50, 100)],
    "off_policyness": [(m, f"specs/{m}.yaml", []) for m in ("sft", "opd", "opsd", "grpo")],
}


@dataclass
class Variant:
    label: str
    spec: str
    overrides: list[str] = field(default_factory=list)
    study: str = ""
    sweep: tuple[str, str] | None = None  # (field, value) when the variant comes from --sweep


def variants_from(specs: list[str], sweep: str | None, overrides: list[str] = ()) -> list[Variant]:
    """One variant per spec (and sweep value); `overrides` apply to every one, before the sweep's."""
    out = []
    for spec in specs:
        name = Path(spec).stem
        if not sweep:
            out.append(Variant(name, spec, list(overrides)))
            continue
        key, values = sweep.split("=", 1)
        for v in values.split(","):
            out.append(Variant(f"{name} {key}={v}", spec, [*overrides, f"{key}={v}"], sweep=(key, v)))
    return out


def samples_per_step(seg) -> int:
    """Policy samples a step of this segment consumes (demonstrations for a no-rollout SFT step)."""
    spec = seg.spec
    from composer.terms import terms

    if all(getattr(sig, "makes_batch", False) for _n, sig, _o, _w in terms(spec)):
        return spec.train.prompts_per_step
    return spec.train.prompts_per_step * spec.rollout.samples_per_prompt


def policy_samples(validated) -> int:
    """Policy samples a whole run of this validated spec consumes."""
    return sum((s.end - s.start) * samples_per_step(s) for s in validated.segments)


def budget_overrides(variant: Variant, budget: int) -> list[str]:
    """Scale train.steps (and stage steps and phase boundaries alike) so the run uses `budget` samples."""
    from composer.validate import validate_file

    v = validate_file(variant.spec, variant.overrides)
    factor = budget / max(policy_samples(v), 1)
    out = []
    if v.spec.stages:
        for i, seg in enumerate(v.segments):
            out.append(f"stages.{i}.train.steps={max(1, round((seg.end - seg.start) * factor))}")
    else:
        steps = max(1, round(v.spec.train.steps * factor))
        out.append(f"train.steps={steps}")
        for i, ph in enumerate(v.spec.phases):
            out.append(f"phases.{i}.until={max(1, round(ph.until * factor))}")
    return out


def run_one(variant: Variant, seed: int, out: Path, cfg: dict) -> dict:
    from composer.backends.lightning.run import train
    from composer.runtime.evaluate import pass_at_k
    from composer.validate import validate_file

    overrides = variant.overrides + budget_overrides(variant, cfg["budget_samples"]) + [
        f"train.seed={seed}", f"train.eval_samples={cfg['eval_samples']}", f"train.eval_every={cfg['eval_every']}"]
    v = validate_file(variant.spec, overrides)
    extra = {}

    def final_eval(ctx, policy):
        for tier in (MIDDLE, HARD):
            exs = ctx.task.eval.get(tier, [])[: cfg["pass_k_problems"]]
            for k, val in pass_at_k(ctx, policy, exs, n=cfg["pass_k_n"]).items():
                extra[sampled_key(k, tier)] = val  # greedy pass@1 keeps the plain name

    t0 = time.perf_counter()
    final = train(v, out, progress=False, final_eval=final_eval)
    wall = time.perf_counter() - t0
    rows = _read(out / "metrics.csv")
    last = {k: v for r in rows for k, v in r.items() if v not in (None, "")}  # each metric's last logged value

    def mean(key):
        vals = [float(r[key]) for r in rows if r.get(key) not in (None, "")]
        return statistics.fmean(vals) if vals else float("nan")

    result = {"label": variant.label, "study": variant.study, "spec": variant.spec, "seed": seed,
              "sweep_field": variant.sweep[0] if variant.sweep else "", "sweep_value": variant.sweep[1] if variant.sweep else "",
              "steps": v.total_steps, "policy_samples": policy_samples(v),
              "wall_s": round(wall, 1),
              "policy_tokens": float(last.get("cost/policy_tokens") or 0),
              "judge_tokens": float(last.get("cost/judge_tokens") or 0),
              "teacher_tokens": float(last.get("cost/teacher_tokens") or 0),
              "reward_mean": mean("reward_mean"), "zero_advantage_frac": mean("zero_advantage_frac"),
              "offpolicy_token_frac": mean("offpolicy_token_frac"),
              "entropy_first": float(rows[0].get("entropy") or "nan") if rows else float("nan"),
              "entropy_last": float(last.get("entropy") or "nan"), "run": str(out)}
    result.update(final)
    result.update(extra)
    return result


def sampled_key(k: int, tier: str) -> str:
    """Column of the unbiased pass@k from sampled answers (k = 1 is not the greedy pass@1)."""
    return f"pass@{k}/{tier}" if k > 1 else f"pass@1_sampled/{tier}"


def sampled_ks(row: dict, tier: str) -> list[int]:
    """The k of every sampled pass@k column of `tier` in a result row."""
    return sorted(int(c.split("@")[1].split("/")[0].removesuffix("_sampled")) for c in row
                  if c.startswith("pass@") and c.endswith("/" + tier) and c != f"pass@1/{tier}")


def _read(path: Path) -> list[dict]:
    if not path.exists():
        return []
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def ci95(values: list[float]) -> tuple[float, float]:
    """Mean and half-width of a normal-approximation 95% interval (0 with one seed)."""
    vals = [v for v in values if not math.isnan(v)]
    if not vals:
        return float("nan"), float("nan")
    m = statistics.fmean(vals)
    if len(vals) < 2:
        return m, 0.0
    return m, 1.96 * statistics.stdev(vals) / math.sqrt(len(vals))


def write_outputs(results: list[dict], out: Path, cfg: dict, command: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    keys = sorted({k for r in results for k in r}, key=lambda k: (k not in ("study", "label", "seed"), k))
    with (out / "results.csv").open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(results)
    lines = [f"# Bench ({time.strftime('%Y-%m-%d')})", "", f"Command: `{command}`", "",
             "Settings (fixed before comparing methods): " + ", ".join(f"{k}={v}" for k, v in cfg.items()) +
             ". Toy testbed: mod-10 arithmetic chains; greedy pass@1 on held-out problems per tier; pass@k unbiased "
             f"from {cfg['pass_k_n']} samples at temperature 1 on {cfg['pass_k_problems']} problems. Mean ± 95% interval "
             "over seeds (normal approximation: with 2 seeds it understates the uncertainty).", ""]
    for study in sorted({r["study"] for r in results}):
        lines += [f"## {study or 'runs'}", "", *study_table([r for r in results if r["study"] == study]), ""]
    lines += ["Plots: " + ", ".join(p.name for p in plots(results, out)), ""]
    (out / "summary.md").write_text("\n".join(lines))


def study_table(rs: list[dict]) -> list[str]:
    """Markdown table, one line per variant: mean ± 95% interval over its seeds."""
    k = max((k for r in rs for k in sampled_ks(r, HARD)), default=1)
    cols = [f"pass@1/{MIDDLE}", f"pass@1/{HARD}", sampled_key(k, MIDDLE), sampled_key(k, HARD), "zero_advantage_frac",
            "offpolicy_token_frac", "entropy_last", "judge_tokens", "teacher_tokens", "wall_s"]
    lines = ["| variant | " + " | ".join(cols) + " |", "| --- |" + " --- |" * len(cols)]
    for label in dict.fromkeys(r["label"] for r in rs):
        cells = []
        for c in cols:
            m, h = ci95([float(r.get(c, "nan")) for r in rs if r["label"] == label])
            if math.isnan(m):
                cells.append("n/a")  # not measured by this method (no reward: no zero-advantage groups)
            else:
                cells.append(f"{m:.0f}" if c in ("judge_tokens", "teacher_tokens", "wall_s") else f"{m:.3f} ± {h:.3f}")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return lines


BEGIN, END = "<!-- bench results: begin (composer bench --readme) -->", "<!-- bench results: end -->"


def readme_section(out: Path, readme: Path, images: Path, study: str = "methods") -> str:
    """Write `study`'s table and plot from the bench folder `out` into `readme` between the bench markers
    (the plot is copied into `images`). Returns the section."""
    import shutil

    results = json.loads((out / "results.json").read_text())
    summary = (out / "summary.md").read_text().splitlines()
    date = summary[0].removeprefix("# Bench (").rstrip(")")
    command = next(line for line in summary if line.startswith("Command:")).removeprefix("Command: ").strip("`")
    settings = next(line for line in summary if line.startswith("Settings"))
    rs = [r for r in results if r["study"] == study]
    if not rs:
        raise ValueError(f"{out}: no results for study {study!r}")
    images.mkdir(parents=True, exist_ok=True)
    shutil.copy(out / f"{study}.png", images / f"{study}.png")
    rel = (images / f"{study}.png").resolve().relative_to(readme.resolve().parent)
    section = "\n".join([BEGIN, f"Generated on {date} by `{command}`. {settings}", "",
                         *study_table(rs), "", f"![{study}: pass@1 against policy samples, pass@k, entropy]({rel})",
                         END])
    text = readme.read_text()
    if BEGIN in text and END in text:
        text = text[: text.index(BEGIN)] + section + text[text.index(END) + len(END):]
    else:
        text = text.rstrip("\n") + "\n\n" + section + "\n"
    readme.write_text(text)
    return section


def plots(results: list[dict], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    made = []
    for study in sorted({r["study"] for r in results}):
        rs = [r for r in results if r["study"] == study]
        tag = study or "runs"
        fig, axes = plt.subplots(1, 4, figsize=(18, 3.8))
        for label in dict.fromkeys(r["label"] for r in rs):
            runs = [r for r in rs if r["label"] == label]
            r0 = runs[0]
            per_step = r0["policy_samples"] / max(r0["steps"], 1)
            logs = [_read(Path(r["run"]) / "metrics.csv") for r in runs]
            for ax, tier in ((axes[0], HARD), (axes[1], MIDDLE)):
                xs, ys = _curve(logs, f"pass@1/{tier}")
                ax.plot([x * per_step for x in xs], ys, marker=".", label=label)
            ks = sampled_ks(r0, HARD)
            axes[2].plot(ks, [statistics.fmean(float(r[sampled_key(k, HARD)]) for r in runs) for k in ks],
                         marker="o", label=label)
            xs, ys = _curve(logs, "entropy")
            w = 5  # rolling mean over 5 steps: per-step entropy of 64 rollouts is noisy
            smooth = [statistics.fmean(ys[max(0, i - w + 1): i + 1]) for i in range(len(ys))]
            axes[3].plot(xs, smooth, label=label)
        axes[0].set(title=f"hard ({HARD}) pass@1", xlabel="policy samples")
        axes[1].set(title=f"middle ({MIDDLE}) pass@1", xlabel="policy samples")
        axes[2].set(title=f"pass@k ({HARD})", xlabel="k", xscale="log")
        axes[3].set(title="entropy (5-step mean)", xlabel="step")
        axes[3].legend(fontsize=6)
        fig.tight_layout()
        path = out / f"{tag}.png"
        fig.savefig(path, dpi=90)
        plt.close(fig)
        made.append(path)
        sweep = [r for r in rs if r.get("sweep_field")]
        if sweep:
            fig, ax = plt.subplots(figsize=(5, 3.5))
            vals = list(dict.fromkeys(r["sweep_value"] for r in sweep))
            for tier in (MIDDLE, HARD):
                ax.plot(vals, [statistics.fmean(float(r[f"pass@1/{tier}"]) for r in sweep if r["sweep_value"] == v)
                               for v in vals], marker="o", label=tier)
            ax.set(xlabel=sweep[0]["sweep_field"], ylabel="final pass@1")
            ax.legend()
            fig.tight_layout()
            path = out / f"{tag}-sweep.png"
            fig.savefig(path, dpi=90)
            plt.close(fig)
            made.append(path)
    return made


def _curve(runs: list[list[dict]], key: str) -> tuple[list[float], list[float]]:
    """Mean over seeds of a metric against step (steps where every seed has it)."""
    per = [{int(r["step"]): float(r[key]) for r in rows if r.get(key) not in (None, "")} for rows in runs]
    steps = sorted(set.intersection(*[set(p) for p in per])) if per else []
    return steps, [statistics.fmean(p[s] for p in per) for s in steps]


def bench(variants: list[Variant], out: Path, cfg: dict, command: str, log=print) -> list[dict]:
    results = []
    done: dict[tuple, dict] = {}  # the same spec, overrides and seed in two studies run once
    for v in variants:
        for seed in range(cfg["seeds"]):
            name = "".join(c if c.isalnum() or c in "-_." else "_" for c in f"{v.study}-{v.label}").strip("-_")
            key = (v.spec, tuple(v.overrides), seed)
            if key in done:
                results.append({**done[key], "label": v.label, "study": v.study})
                log(f"[bench] {v.label} seed {seed}: same run as {done[key]['label']} ({done[key]['study']})")
            else:
                log(f"[bench] {v.label} seed {seed} ...")
                r = run_one(v, seed, out / "runs" / name / f"seed{seed}", cfg)
                done[key] = r
                results.append(r)
                log(f"[bench] {v.label} seed {seed}: pass@1 {MIDDLE} {r.get('pass@1/' + MIDDLE, float('nan')):.3f}, "
                    f"{HARD} {r.get('pass@1/' + HARD, float('nan')):.3f} ({r['wall_s']} s)")
            write_outputs(results, out, cfg, command)
            (out / "results.json").write_text(json.dumps(results, indent=1, default=str))
    return results
