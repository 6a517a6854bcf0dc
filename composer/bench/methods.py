"""`composer bench`: methods side by side on the toy testbed at an equal budget of policy samples.

Each (spec, sweep value, seed) is an ordinary run; the bench only chooses its length so that every
method sees the same number of policy-generated samples, then evaluates the final policy the same
way for all: greedy pass@1 per tier and unbiased pass@k from sampled answers. The judge's and the
teacher's inference are reported as separate cost columns, for compute-matched reading.

The settings below (DEFAULTS, SUITE, CLAIMS) were fixed before any method was compared, are written
down in docs/bench/settings.md and go into summary.md. `--suite seeds` on a held-out toy variant
(COMPOSER_TOY_VARIANT=mod7, components/tasks/toy.py) reruns the same studies there.
"""

from __future__ import annotations

import csv
import json
import math
import re
import shutil
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

DEFAULTS = {
    "budget_samples": 4096,  # policy-generated samples per run (SFT: demonstrations)
    "seeds": 3,
    "eval_samples": 32,  # held-out problems per tier for greedy pass@1
    "pass_k_n": 32,  # samples per problem for pass@k (k = 1..32)
    "pass_k_problems": 16,
    "eval_every": 10,
    "entropy_n": 4,  # samples per problem for entropy_heldout (the pass@k problems, temperature 1)
}
QUICK = {"budget_samples": 256, "seeds": 1, "eval_samples": 8, "pass_k_n": 4, "pass_k_problems": 4, "eval_every": 2,
         "entropy_n": 2}
MIDDLE, HARD = "tier6", "tier8"  # the student solves tiers 1-4 at the start (bootstrap), so 6 is the middle
BOTH = "tier6+8"  # derived columns: the mean over the middle and hard tiers (2 x eval_samples problems)
EXTRA_SEEDS = 5  # pre-registered: a claim whose primary difference is within one interval gets seeds 3-4 on its arms

# Intervention intensity (MInTRL): a setting whose answers are long enough for the knob to reach 40%
# off-policy tokens: 8-step chains join the training tiers (answers up to 51 tokens; the student errs
# from their first line), the judge reviews every step line (chunk_tokens 6) and max_reviews is the knob.
# Issue 26: over the whole intervention phase that reached 30%, not 40%; by the procedure fixed in
# docs/bench/settings.md before rerunning, 10-step chains join too (calibration, seed 0, max_reviews 16: 51.8%).
INTENSITY_SETTING = ["data.train_tiers=[2,4,6,8,10]", "rollout.guide.chunk_tokens=6", "train.samples_every=1"]
INTENSITY_REVIEWS = (0, 1, 2, 4, 16)
# Lag (OAPL vs GRPO): 4 prompts x 8 samples per step, so the 4096-sample budget is 128 steps: lag 24
# syncs at steps 24, 48, 72, 96 and 120 (5 syncs inside the run).
LAG_SETTING = ["train.prompts_per_step=4", "train.eval_every=16"]
LAGS = (1, 24)


# Without reviews there are no intervention tokens, and the method rules refuse a loss on tokens that never
# occur: the no-intervention arms train on the policy's tokens (all there are), the same loss.
NO_REVIEWS = ["rollout.guide.max_reviews=0", "objective.loss_tokens=[policy]"]


def _intensity(r: int) -> tuple:
    knob = NO_REVIEWS if r == 0 else [f"rollout.guide.max_reviews={r}"]
    return (f"mintrl long max_reviews={r}", "specs/mintrl.yaml", [*INTENSITY_SETTING, *knob])


def _lag(m: str, lag: int) -> tuple:
    # an on-policy objective (GRPO) must be allowed to read lagged rollouts; OAPL is built for them, and at lag 1
    # there is no lag: the permission would be inert there, and is refused
    lagged = ["sync.off_policy_ok=true"] if lag > 1 and m != "oapl" else []
    return (f"{m} sync.every={lag}", f"specs/{m}.yaml", [*LAG_SETTING, *lagged, f"sync.every={lag}"])


_M = {m: (m, f"specs/{m}.yaml", []) for m in ("sft", "grpo", "opd", "opsd", "sdpo", "pope", "int", "oapl", "mintrl")}
_MINTRL_OFF = ("mintrl max_reviews=0", "specs/mintrl.yaml", list(NO_REVIEWS))
SUITE = {  # study -> list of (label, spec, overrides)
    "methods": list(_M.values()),
    "coverage": [_M["grpo"], _M["mintrl"], _MINTRL_OFF, _M["int"], _M["pope"]],
    "intensity": [_intensity(r) for r in INTENSITY_REVIEWS],
    "lag": [_lag(m, L) for m in ("oapl", "grpo") for L in LAGS],
    "off_policyness": [_M[m] for m in ("sft", "opd", "opsd", "grpo")],
}
# The arms the four claims' verdicts read (every one is also a run of a study above, so it runs once);
# `--study claims` alone runs just these (the held-out variant).
SUITE["claims"] = [_M["grpo"], _M["mintrl"], _MINTRL_OFF, *SUITE["intensity"], *SUITE["lag"],
                   _M["sft"], _M["opd"], _M["opsd"]]
# InT against GRPO alone (issue 41): GRPO from InT's own start (toy:instruct) on InT's training tiers, i.e. InT's
# stage 2 without its stage 1 (tests/test_bench_int.py holds the two to that). Not one of the four seed claims.
INT_GRPO = ("grpo from toy:instruct", "specs/grpo.yaml", ["policy.model=toy:instruct", "data.train_tiers=[4,6]"])
SUITE["int"] = [_M["int"], INT_GRPO]
# study -> the arm whose measured policy samples every other arm of the study is given, seed by seed: InT's
# proposals and filter continuations depend on how many attempts fail, so its spend is known only once it ran
# (`policy_samples_used`, cost/policy_samples); GRPO seed s then runs for what InT seed s used.
MATCHED = {"int": "int"}

# The pre-registered claims: the arms, the primary metric, and the comparisons the verdict rests on.
# A difference is established when its 95% interval (Welch, Student t) excludes 0.
CLAIMS = {
    "coverage": {
        "claim": "MInTRL's interventions expand coverage beyond GRPO's (paper: 35.45 vs 17.74)",
        "metric": f"pass@32/{BOTH}",
        "rule": "reproduced if MInTRL - GRPO > 0 is established, contradicted if < 0 is; the same spec without "
                "interventions (max_reviews=0) tells whether a difference comes from the interventions",
        "arms": {"grpo": "grpo", "mintrl": "mintrl", "mintrl_off": "mintrl max_reviews=0"},
    },
    "intensity": {
        "claim": "Inverse U in intervention intensity: a little intervention beats none, 40% off-policy tokens "
                 "are worse than none",
        "metric": f"pass@1/{BOTH}",
        "rule": "low = the lowest non-zero intensity (max_reviews=1), high = the arm whose measured intensity is "
                "closest to 40% (both candidates, each with its verdict, when their intensities are within 2 "
                "points); reproduced if low - none > 0 and none - high > 0 are both established, "
                "contradicted if none - low > 0 or high - none > 0 is",
        "arms": {f"r{r}": _intensity(r)[0] for r in INTENSITY_REVIEWS},
    },
    "lag": {
        "claim": "OAPL stays stable at large lag; GRPO degrades",
        "metric": f"pass@1/{BOTH}",
        "rule": f"d(M) = M at lag {LAGS[-1]} - M at lag {LAGS[0]}; reproduced if d(GRPO) < 0 and d(OAPL) - d(GRPO) > 0 "
                "are both established, contradicted if d(OAPL) < 0 or d(OAPL) - d(GRPO) < 0 is",
        "arms": {f"{m}{L}": _lag(m, L)[0] for m in ("oapl", "grpo") for L in LAGS},
    },
    "off_policyness": {
        "claim": "SFT, the most off-policy, narrows the distribution most (seed 000)",
        "metric": "entropy_heldout",
        "rule": "entropy_heldout: the final policy's per-token entropy at temperature 1 on its own samples of the "
                "same held-out prompts for every method; reproduced if SFT's is below each of OPD's, OPSD's and "
                "GRPO's (all three established), contradicted if any of them is established below SFT's",
        "arms": {m: m for m in ("sft", "opd", "opsd", "grpo")},
    },
    "int": {
        "claim": "InT (SFT on self-proposed interventions, then RL) beats RL alone from the same start at an equal "
                 "budget of policy samples (paper: InT then RL over RL on the 4B instruct base; interventions about "
                 "2% of the tokens)",
        "metric": f"pass@1/{BOTH}",
        "rule": "InT - GRPO, GRPO from InT's start (toy:instruct) on InT's tiers with InT's measured policy samples "
                "(attempts, proposals, filter continuations, RL rollouts) seed by seed; reproduced if > 0 is "
                "established, contradicted if < 0 is",
        "arms": {"int": "int", "grpo": INT_GRPO[0]},
    },
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
    """Policy samples a step of this segment consumes: its rollouts, or the demonstrations of a no-rollout SFT
    step; none for a step that trains on targets its signal built ahead (their attempts: `samples_ahead`)."""
    spec = seg.spec
    from composer.checks.terms import terms

    sigs = [sig for _n, sig, _o, _w in terms(spec)]
    if all(sig is not None and sig.makes_batch for sig in sigs):
        return 0 if any(sig.builds_ahead for sig in sigs) else spec.train.prompts_per_step
    return spec.train.prompts_per_step * spec.rollout.samples_per_prompt


def samples_ahead(seg) -> int:
    """Rollouts a segment's signals sample once at its start (InT's offline attempts: problems x samples per
    prompt). Their proposals and filter continuations depend on how many attempts fail: not known before the
    run, they are counted as they are sampled (cost/policy_samples: the result's `policy_samples_used`)."""
    from composer.checks.terms import terms

    return sum(sig.rollouts_ahead(seg.spec, seg.end - seg.start) for _n, sig, _o, _w in terms(seg.spec)
               if sig is not None)


def policy_samples(validated) -> int:
    """Policy samples a whole run of this validated spec is known to consume before it runs."""
    return sum((s.end - s.start) * samples_per_step(s) + samples_ahead(s) for s in validated.segments)


def budget_overrides(variant: Variant, budget: int) -> list[str]:
    """Scale train.steps (and stage steps and phase boundaries alike) so the run uses `budget` samples."""
    from composer.checks.validate import validate_file

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


def run_overrides(variant: Variant, seed: int, cfg: dict) -> list[str]:
    """Every override of one bench run: the bench's evaluation settings (a variant's own win), the variant's,
    its budget, and the seed."""
    return [f"train.eval_samples={cfg['eval_samples']}", f"train.eval_every={cfg['eval_every']}", *variant.overrides,
            *budget_overrides(variant, cfg["budget_samples"]), f"train.seed={seed}"]


def run_key(variant: Variant, seed: int, cfg: dict) -> dict:
    """What makes two bench runs the same run: spec, overrides, seed, the evaluation settings and the toy variant."""
    from components.tasks.toy import variant as toy_variant

    return {"spec": str(variant.spec), "overrides": list(variant.overrides), "seed": seed, "toy": toy_variant(),
            **{k: cfg[k] for k in sorted(cfg) if k != "seeds"}}


def run_one(variant: Variant, seed: int, out: Path, cfg: dict) -> dict:
    from composer.backends.lightning.run import train
    from composer.runtime.evaluate import heldout_entropy, pass_at_k
    from composer.checks.validate import validate_file

    v = validate_file(variant.spec, run_overrides(variant, seed, cfg))
    extra = {}

    def final_eval(ctx, policy):
        held = []
        for tier in (MIDDLE, HARD):
            exs = ctx.task.eval.get(tier, [])[: cfg["pass_k_problems"]]
            held += exs
            # temperature 1 for every method (settings.md), not each spec's rollout sampling (OPSD 1.1, InT 0.7)
            for k, val in pass_at_k(ctx, policy, exs, n=cfg["pass_k_n"], temperature=1.0).items():
                extra[sampled_key(k, tier)] = val  # greedy pass@1 keeps the plain name
        extra["entropy_heldout"] = heldout_entropy(ctx, policy, held, n=cfg.get("entropy_n", 4), seed=seed)

    t0 = time.perf_counter()
    final = train(v, out, progress=False, final_eval=final_eval)
    wall = time.perf_counter() - t0
    rows = _read(out / "metrics.csv")
    last = {k: v for r in rows for k, v in r.items() if v not in (None, "")}  # each metric's last logged value

    def mean(key, rs=rows):
        vals = [float(r[key]) for r in rs if r.get(key) not in (None, "")]
        return statistics.fmean(vals) if vals else float("nan")

    from components.tasks.toy import variant as toy_variant

    result = {"label": variant.label, "study": variant.study, "spec": variant.spec, "seed": seed, "toy": toy_variant(),
              "sweep_field": variant.sweep[0] if variant.sweep else "", "sweep_value": variant.sweep[1] if variant.sweep else "",
              "steps": v.total_steps, "policy_samples": policy_samples(v),
              "wall_s": round(wall, 1),
              "policy_tokens": float(last.get("cost/policy_tokens") or 0),
              "judge_tokens": float(last.get("cost/judge_tokens") or 0),
              "teacher_tokens": float(last.get("cost/teacher_tokens") or 0),
              "reward_mean": mean("reward_mean"), "zero_advantage_frac": mean("zero_advantage_frac"),
              "reward_last": mean("reward_mean", rows[len(rows) - max(1, len(rows) // 4):]),  # the last quarter
              "offpolicy_token_frac": mean("offpolicy_token_frac"),
              "offpolicy_guided": guided_offpolicy(out / "samples.jsonl"),
              "entropy_first": float(rows[0].get("entropy") or "nan") if rows else float("nan"),
              "entropy_last": float(last.get("entropy") or "nan"), "run": str(out),
              "policy_samples_used": float(last.get("cost/policy_samples") or "nan"),
              "offpolicy_share_trained": token_share(rows)}
    result.update(int_facts(last))
    result.update(final)
    result.update(extra)
    return result


def token_share(rows: list[dict]) -> float:
    """The share of off-policy tokens (a guide's, demonstrations) among the response tokens of every step, each
    step weighted by its tokens (`response_tokens`; NaN for a log without it)."""
    num = den = 0.0
    for r in rows:
        if r.get("response_tokens") not in (None, "") and r.get("offpolicy_token_frac") not in (None, ""):
            num += float(r["offpolicy_token_frac"]) * float(r["response_tokens"])
            den += float(r["response_tokens"])
    return num / den if den else float("nan")


INT_PREFIX = "int_offline/"


def int_facts(last: dict) -> dict:
    """InT's offline build (components/signals/sft.py collect_targets) from a run's metrics: its counts, the
    share of intervention tokens in the targets stage 1 trains on (`intervention_share_sft`), the share of
    continuations that succeeded over every filter test (`continuation_success`; the paper: 4.27%) and over
    the kept targets' own tests (`kept_continuation_success`). Empty for a run without one."""
    c = {k.removeprefix(INT_PREFIX): float(v) for k, v in last.items() if k.startswith(INT_PREFIX)}
    if not c:
        return {}

    def ratio(a, b):
        return c[a] / c[b] if c.get(b) else float("nan")

    return {**{INT_PREFIX + k: v for k, v in c.items()},
            "intervention_share_sft": ratio("intervention_tokens", "target_tokens"),
            "continuation_success": ratio("continuation_successes", "continuations"),
            "kept_continuation_success": ratio("kept_continuation_successes", "kept_continuations")}


def guided_offpolicy(samples: Path) -> float:
    """Intervention intensity as the paper states it, per trajectory a guide may touch: the fraction of the
    response tokens of non-control rollouts that a guide wrote, over the segments (phases) in which the guide
    reviewed anything, from the run's samples.jsonl. NaN for a run without a reviewing guide (or no samples)."""
    if not samples.exists():
        return float("nan")
    rows = []
    with samples.open() as f:
        for line in f:
            try:
                rows.append(json.loads(line))
            except ValueError:
                continue
    active = {r.get("segment") for r in rows if (r.get("guide") or {}).get("reviews", 0) > 0}
    off = tot = 0
    for r in rows:
        if r.get("segment") in active and not r.get("control"):
            for span in r.get("spans", []):
                tot += span.get("tokens", 0)
                off += span.get("tokens", 0) if span.get("origin") in ("guide_prefix", "guide_intervention") else 0
    return off / tot if tot else float("nan")


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


T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145,
        2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)


def t975(df: float) -> float:
    """The 97.5% quantile of Student's t with `df` degrees of freedom (a fractional df rounds down: wider)."""
    d = math.floor(df)
    return T975[d - 1] if 1 <= d <= len(T975) else (1.96 if d > len(T975) else float("inf"))


def ci95(values: list[float]) -> tuple[float, float]:
    """Mean and half-width of the 95% interval over seeds (Student t, n - 1 degrees of freedom; 0 with one seed)."""
    vals = [v for v in values if not math.isnan(v)]
    if not vals:
        return float("nan"), float("nan")
    m = statistics.fmean(vals)
    if len(vals) < 2:
        return m, 0.0
    return m, t975(len(vals) - 1) * statistics.stdev(vals) / math.sqrt(len(vals))


def diff_ci(*terms: tuple[float, list[float]]) -> dict:
    """A linear contrast sum(c * mean(x)) of independent arms, e.g. ((1, a), (-1, b)) for mean(a) - mean(b), with
    its Welch 95% interval (Satterthwaite degrees of freedom, Student t). Returns {d, lo, hi, half, n}."""
    d = var = 0.0
    parts, ns = [], []
    for c, xs in terms:
        xs = [x for x in xs if not math.isnan(x)]
        if not xs:
            return {"d": float("nan"), "lo": float("nan"), "hi": float("nan"), "half": float("nan"), "n": []}
        d += c * statistics.fmean(xs)
        v = c * c * (statistics.variance(xs) if len(xs) > 1 else 0.0) / len(xs)
        var += v
        parts.append((v, len(xs)))
        ns.append(len(xs))
    if var == 0:
        half = 0.0 if all(n > 1 for n in ns) else float("inf")  # no spread at all: only the resolution limits it
    else:
        df = var * var / sum(v * v / (n - 1) for v, n in parts if n > 1 and v > 0)
        half = t975(df) * math.sqrt(var)
    return {"d": d, "lo": d - half, "hi": d + half, "half": half, "n": ns}


def established(c: dict) -> int:
    """+1 if the interval is above 0, -1 if below, 0 if it contains 0 (or is undefined)."""
    if math.isnan(c["d"]) or math.isinf(c["half"]):
        return 0
    return 1 if c["lo"] > 0 else -1 if c["hi"] < 0 else 0


def value(row: dict, metric: str) -> float:
    """A result's metric, derived columns included (`pass@k/tier6+8`: the mean of the two tiers)."""
    if metric.endswith("/" + BOTH):
        head = metric[: -len(BOTH)]
        return statistics.fmean([value(row, head + MIDDLE), value(row, head + HARD)])
    try:
        return float(row.get(metric, "nan"))
    except (TypeError, ValueError):
        return float("nan")


def settings_line(cfg: dict) -> str:
    from components.tasks.toy import VARIANTS
    from components.tasks.toy import variant as toy_variant

    toy = cfg.get("toy") or toy_variant()
    m = VARIANTS[toy]["modulus"]
    return ("Settings (fixed before comparing methods; docs/bench/settings.md): " +
            ", ".join(f"{k}={v}" for k, v in cfg.items() if k != "toy") +
            f". Toy testbed `{toy}`: mod-{m} arithmetic chains; greedy pass@1 on held-out problems per tier; pass@k "
            f"unbiased from {cfg['pass_k_n']} samples at temperature 1 on {cfg['pass_k_problems']} problems. Mean ± 95% "
            "interval over seeds (Student t, n - 1 degrees of freedom; n = seeds, in the n column).")


def write_outputs(results: list[dict], out: Path, cfg: dict, command: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    keys = sorted({k for r in results for k in r}, key=lambda k: (k not in ("study", "label", "seed"), k))
    with (out / "results.csv").open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(results)
    lines = [f"# Bench ({time.strftime('%Y-%m-%d')})", "", f"Command: `{command}`", "", settings_line(cfg), ""]
    for study in sorted({r["study"] for r in results}):
        lines += [f"## {study or 'runs'}", "", *study_table([r for r in results if r["study"] == study], study), ""]
    verdicts = claim_verdicts(results)
    if verdicts:
        lines += ["## verdicts", "", *claims_table(verdicts), ""]
    made = plots(results, out)
    if verdicts:
        made.append(claims_plot(results, verdicts, out / "verdicts.png"))
    lines += ["Plots: " + ", ".join(p.name for p in made), ""]
    (out / "summary.md").write_text("\n".join(lines))


STUDY_COLS = {
    "intensity": ["offpolicy_guided", "offpolicy_token_frac", f"pass@1/{BOTH}", f"pass@1/{MIDDLE}", f"pass@1/{HARD}",
                  f"pass@32/{BOTH}", "reward_last", "entropy_last", "entropy_heldout", "judge_tokens", "wall_s"],
    "lag": [f"pass@1/{BOTH}", f"pass@1/{MIDDLE}", f"pass@1/{HARD}", f"pass@32/{BOTH}", "reward_last", "entropy_last",
            "wall_s"],
}
STUDY_COLS["int"] = [f"pass@1/{BOTH}", f"pass@1/{MIDDLE}", f"pass@1/{HARD}", f"pass@32/{BOTH}", f"pass@32/{MIDDLE}",
                     f"pass@32/{HARD}", "policy_samples_used", "steps", "offpolicy_share_trained",
                     "intervention_share_sft", "reward_last", "entropy_heldout", "judge_tokens", "wall_s"]
# InT's stage 1, per run: attempts, failed ones, and what each filter did with them (second table of the study)
INT_FILTER_COLS = [INT_PREFIX + k for k in ("attempts", "failed", "interventions", "leaks", "filtered", "kept",
                                            "proposals", "leaked_proposals", "tested_proposals", "continuations")] + [
    "continuation_success", "kept_continuation_success", "intervention_share_sft"]
INT_FILTER_NOTE = ("InT's stage 1 per run (offline targets: attempts, the failed ones, those with a readable "
                   "intervention, those whose every intervention stated the answer (leaks), those no continuation "
                   "completed (filtered), kept; proposals readable, dropped as leaks, tested; continuations sampled "
                   "and the share that succeeded, over all tests and over the kept targets' own; intervention tokens "
                   "among the tokens stage 1 trains on):")
COUNTS = ("judge_tokens", "teacher_tokens", "wall_s", "policy_samples_used", "steps")


def study_table(rs: list[dict], study: str = "") -> list[str]:
    """Markdown table, one line per variant: seeds, then mean ± 95% interval over its seeds (the InT study: a
    second table of InT's stage-1 counts)."""
    k = max((k for r in rs for k in sampled_ks(r, HARD)), default=1)
    cols = STUDY_COLS.get(study) or [
        f"pass@1/{MIDDLE}", f"pass@1/{HARD}", sampled_key(k, MIDDLE), sampled_key(k, HARD), "zero_advantage_frac",
        "offpolicy_token_frac", "entropy_last", "entropy_heldout", "judge_tokens", "teacher_tokens", "wall_s"]
    lines = _table(rs, cols)
    if study == "int" and any(INT_FILTER_COLS[0] in r for r in rs):
        lines += ["", INT_FILTER_NOTE, "", *_table([r for r in rs if INT_FILTER_COLS[0] in r], INT_FILTER_COLS)]
    return lines


def _table(rs: list[dict], cols: list[str]) -> list[str]:
    lines = ["| variant | n | " + " | ".join(cols) + " |", "| --- | --- |" + " --- |" * len(cols)]
    for label in dict.fromkeys(r["label"] for r in rs):
        mine = [r for r in rs if r["label"] == label]
        cells = []
        for c in cols:
            m, h = ci95([value(r, c) for r in mine])
            if math.isnan(m):
                cells.append("n/a")  # not measured by this method (no reward: no zero-advantage groups)
            elif c in ("policy_samples_used", "steps"):
                cells.append(f"{m:.0f} ± {h:.0f}")
            elif c in COUNTS:
                cells.append(f"{m:.0f}")
            elif c.startswith(INT_PREFIX):
                cells.append(f"{m:.1f} ± {h:.1f}")
            else:
                cells.append(f"{m:.3f} ± {h:.3f}")
        lines.append(f"| {label} | {len(mine)} | " + " | ".join(cells) + " |")
    return lines


# ------------------------------------------------------------------------------------------ claims


def arm(results: list[dict], label: str, metric: str) -> list[float]:
    """The metric over the seeds of the runs labelled `label` (in any study: a shared run counts once)."""
    by_seed = {r["seed"]: r for r in results if r["label"] == label}
    return [value(by_seed[s], metric) for s in sorted(by_seed)]


def _fmt(c: dict) -> str:
    if math.isnan(c["d"]):
        return "n/a"
    p = c.get("places", 3)
    return f"{c['d']:+.{p}f} [{c['lo']:+.{p}f}, {c['hi']:+.{p}f}]"


def _mean(xs: list[float], places: int = 3) -> str:
    m, h = ci95(xs)
    return "n/a" if math.isnan(m) else f"{m:.{places}f} ± {h:.{places}f}"


def claim_verdicts(results: list[dict]) -> list[dict]:
    """The pre-registered verdict of each claim (CLAIMS) whose arms are all in `results`: the comparisons
    (difference of means with its Welch 95% interval), `verdict` (reproduced / contradicted / undecided) and
    `extend` (the arms to give EXTRA_SEEDS seeds: a difference within one interval)."""
    labels = {r["label"] for r in results}
    out = []
    for name, spec in CLAIMS.items():
        if not set(spec["arms"].values()) <= labels:
            continue
        metric, A = spec["metric"], spec["arms"]

        def x(key, metric=metric, A=A):
            return arm(results, A[key], metric)

        comps, notes = [], []
        if name == "coverage":
            main = diff_ci((1, x("mintrl")), (-1, x("grpo")))
            comps = [("MInTRL - GRPO", main, f"{_mean(x('mintrl'))} vs {_mean(x('grpo'))}"),
                     ("MInTRL - MInTRL without interventions", diff_ci((1, x("mintrl")), (-1, x("mintrl_off"))),
                      f"{_mean(x('mintrl'))} vs {_mean(x('mintrl_off'))}")]
            for sec in (f"pass@1/{BOTH}", "zero_advantage_frac"):
                comps.append((f"MInTRL - GRPO, {sec}", diff_ci((1, x("mintrl", sec)), (-1, x("grpo", sec))),
                              f"{_mean(x('mintrl', sec))} vs {_mean(x('grpo', sec))}"))
            e = established(main)
            verdict = {1: "reproduced", -1: "contradicted", 0: "undecided"}[e]
            decisive = [main]
            arms_used = ["grpo", "mintrl"]
        elif name == "intensity":
            inten = {k: ci95(x(k, "offpolicy_guided"))[0] for k in A}
            none = next(k for k in A if k.endswith("r0"))
            nonzero = [k for k in A if k != none and not math.isnan(inten[k])]
            low = min(nonzero, key=lambda k: int(k[1:]))
            highs = high_candidates(inten, nonzero)
            c_low = diff_ci((1, x(low)), (-1, x(none)))
            comps = [(f"low ({A[low].split()[-1]}, {inten[low]:.1%}) - none", c_low, f"{_mean(x(low))} vs {_mean(x(none))}")]
            per_high = []
            for high in highs:
                c_high = diff_ci((1, x(none)), (-1, x(high)))
                comps.append((f"none - high ({A[high].split()[-1]}, {inten[high]:.1%})", c_high,
                              f"{_mean(x(none))} vs {_mean(x(high))}"))
                e1, e2 = established(c_low), established(c_high)
                per_high.append((high, c_high, "reproduced" if e1 == 1 and e2 == 1
                                 else "contradicted" if -1 in (e1, e2) else "undecided"))
            notes.append("intensity (off-policy tokens of guided rollouts, intervention phase) per arm: " +
                         ", ".join(f"{A[k].split()[-1]} {inten[k]:.1%}" for k in A if not math.isnan(inten[k])))
            if len({v for *_, v in per_high}) == 1:
                verdict = per_high[0][2]
            else:  # the two candidate high arms disagree: both verdicts, neither chosen after the fact
                verdict = " / ".join(f"{v} (high = {A[h].split()[-1]})" for h, _, v in per_high)
            if len(highs) > 1:
                notes.append(f"two candidate high arms within {HIGH_TIE:.0%} of each other's intensity: "
                             + " and ".join(A[h].split()[-1] for h in highs) + "; the verdict is given for each")
            decisive = [c_low, *(c for _, c, _ in per_high)]
            arms_used = [none, low, *highs]
        elif name == "lag":
            lo_lag, hi_lag = LAGS[0], LAGS[-1]
            dg = diff_ci((1, x(f"grpo{hi_lag}")), (-1, x(f"grpo{lo_lag}")))
            do = diff_ci((1, x(f"oapl{hi_lag}")), (-1, x(f"oapl{lo_lag}")))
            inter = diff_ci((1, x(f"oapl{hi_lag}")), (-1, x(f"oapl{lo_lag}")), (-1, x(f"grpo{hi_lag}")),
                            (1, x(f"grpo{lo_lag}")))
            comps = [(f"GRPO: lag {hi_lag} - lag {lo_lag}", dg, f"{_mean(x(f'grpo{hi_lag}'))} vs {_mean(x(f'grpo{lo_lag}'))}"),
                     (f"OAPL: lag {hi_lag} - lag {lo_lag}", do, f"{_mean(x(f'oapl{hi_lag}'))} vs {_mean(x(f'oapl{lo_lag}'))}"),
                     ("d(OAPL) - d(GRPO)", inter, "")]
            for sec in ("reward_last", "entropy_last"):
                for m in ("grpo", "oapl"):
                    comps.append((f"{m.upper()}: lag {hi_lag} - lag {lo_lag}, {sec}",
                                  diff_ci((1, x(f"{m}{hi_lag}", sec)), (-1, x(f"{m}{lo_lag}", sec))),
                                  f"{_mean(x(f'{m}{hi_lag}', sec))} vs {_mean(x(f'{m}{lo_lag}', sec))}"))
            eg, eo, ei = established(dg), established(do), established(inter)
            verdict = ("reproduced" if eg == -1 and ei == 1 else "contradicted" if eo == -1 or ei == -1 else "undecided")
            decisive = [dg, inter]
            arms_used = list(A)
        elif name == "int":
            main = diff_ci((1, x("int")), (-1, x("grpo")))
            comps = [("InT - GRPO", main, f"{_mean(x('int'))} vs {_mean(x('grpo'))}")]
            for sec in (f"pass@32/{BOTH}", f"pass@1/{MIDDLE}", f"pass@1/{HARD}", "policy_samples_used"):
                p = 0 if sec in COUNTS else 3  # samples are whole numbers
                comps.append((f"InT - GRPO, {sec}", {**diff_ci((1, x("int", sec)), (-1, x("grpo", sec))), "places": p},
                              f"{_mean(x('int', sec), p)} vs {_mean(x('grpo', sec), p)}"))
            for what in ("intervention_share_sft", "offpolicy_share_trained", "continuation_success",
                         "kept_continuation_success"):
                notes.append(f"InT's {what}: {_mean(x('int', what))}")
            verdict = {1: "reproduced", -1: "contradicted", 0: "undecided"}[established(main)]
            decisive = [main]
            arms_used = ["int", "grpo"]
        else:  # off_policyness
            cs = [(f"{m.upper()} - SFT", diff_ci((1, x(m)), (-1, x("sft"))), f"{_mean(x(m))} vs {_mean(x('sft'))}")
                  for m in ("opd", "opsd", "grpo")]
            comps = list(cs)
            for sec in (f"pass@32/{BOTH}",):
                comps.append((f"GRPO - SFT, {sec}", diff_ci((1, x("grpo", sec)), (-1, x("sft", sec))),
                              f"{_mean(x('grpo', sec))} vs {_mean(x('sft', sec))}"))
            es = [established(c) for _, c, _ in cs]
            verdict = "reproduced" if all(e == 1 for e in es) else "contradicted" if -1 in es else "undecided"
            decisive = [c for _, c, _ in cs]
            arms_used = list(A)
        extend = "undecided" in verdict and any(
            established(c) == 0 and not math.isnan(c["d"]) and abs(c["d"]) < c["half"] for c in decisive)
        out.append({"name": name, "claim": spec["claim"], "metric": metric, "rule": spec["rule"], "verdict": verdict,
                    "comparisons": comps, "notes": notes, "extend": [A[k] for k in arms_used] if extend else [],
                    "seeds": sorted({len(x(k)) for k in arms_used})})
    return out


HIGH_TARGET, HIGH_TIE = 0.40, 0.02  # pre-registered (issue 26): the high arm is the one nearest 40% off-policy


def high_candidates(inten: dict, arms: list) -> list:
    """The intensity study's *high* arm: the arm whose measured intensity is nearest 40%; when the runner-up's
    intensity is within 2 points of the nearest one's, both (the verdict is then reported for each, so the
    choice between two near-equal arms is never made after seeing their pass rates)."""
    ranked = sorted(arms, key=lambda k: abs(inten[k] - HIGH_TARGET))
    out = ranked[:1]
    if len(ranked) > 1 and abs(inten[ranked[1]] - inten[ranked[0]]) <= HIGH_TIE:
        out.append(ranked[1])
    return out


def claims_table(verdicts: list[dict]) -> list[str]:
    """Markdown: per claim its comparisons (difference [95% interval], the two means) and the verdict."""
    lines = ["| claim | primary metric | comparison | difference [95% interval] | means | seeds | verdict |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for v in verdicts:
        for i, (what, c, means) in enumerate(v["comparisons"]):
            head = (f"{v['name']}: {v['claim']}", v["metric"]) if i == 0 else ("", "")
            seeds = "/".join(map(str, c["n"])) if c["n"] else ""
            lines.append(f"| {head[0]} | {head[1]} | {what} | {_fmt(c)} | {means} | {seeds} | "
                         f"{('**' + v['verdict'] + '**') if i == 0 else ''} |")
    for v in verdicts:
        for n in v["notes"]:
            lines.append(f"\n{v['name']}: {n}.")
    return lines


# ---------------------------------------------------------------------------------- the README


BEGIN, END = "<!-- bench results: begin (composer bench --readme) -->", "<!-- bench results: end -->"


def markers(study: str) -> tuple[str, str]:
    """The markers of `study`'s section: the methods study keeps BEGIN / END; another study has its own pair,
    so that writing it leaves the methods section alone."""
    if study == "methods":
        return BEGIN, END
    return (f"<!-- bench results {study}: begin (composer bench --readme DIR --study {study}) -->",
            f"<!-- bench results {study}: end -->")
PREVIOUS = "previous-methods.md"  # docs/bench/: the methods table before the fixes, to say what moved


def parse_table(text: str) -> dict[str, dict[str, float]]:
    """{variant: {column: mean}} of the first Markdown results table in `text` (cells `m ± h` or numbers)."""
    rows = [ln for ln in text.splitlines() if ln.startswith("|")]
    if len(rows) < 3:
        return {}
    head = [c.strip() for c in rows[0].strip("|").split("|")]
    out = {}
    for ln in rows[2:]:
        cells = [c.strip() for c in ln.strip("|").split("|")]
        vals = {}
        for h, c in zip(head[1:], cells[1:]):
            m = re.match(r"^(-?[\d.]+)", c)
            if m and h != "n":
                vals[h] = float(m.group(1))
        out[cells[0]] = vals
    return out


def moved_table(results: list[dict], previous: dict, seeds_before: int) -> list[str]:
    """Per method and column of the previous table: now (all seeds) - previous. A cell is starred where the
    mean over the previous run's own seeds (0..seeds_before-1) differs from the previous mean too: not only
    the added seeds moved it (training is deterministic per seed and checkpoint)."""
    rs = [r for r in results if r["study"] == "methods"]
    seen = [c for c in dict.fromkeys(c for old in previous.values() for c in old) if c != "wall_s"]
    order = [f"pass@1/{MIDDLE}", f"pass@1/{HARD}", f"pass@32/{MIDDLE}", f"pass@32/{HARD}", "zero_advantage_frac",
             "offpolicy_token_frac", "entropy_last", "entropy_heldout", "judge_tokens", "teacher_tokens"]
    cols = sorted(seen, key=lambda c: order.index(c) if c in order else len(order))
    lines = ["| method | " + " | ".join(cols) + " |", "| --- |" + " --- |" * len(cols)]
    same = []
    for label, old in previous.items():
        mine = [r for r in rs if r["label"] == label]
        if not mine:
            continue
        cells, unchanged = [], True
        for c in cols:
            if c not in old:
                cells.append("n/a")
                continue
            now = ci95([value(r, c) for r in mine])[0]
            early = ci95([value(r, c) for r in mine if r["seed"] < seeds_before])[0]
            if math.isnan(now):
                cells.append("n/a")
                continue
            scale = 1.0 if c in COUNTS else 1000.0
            moved_by_code = not math.isnan(early) and round(early * scale) != round(old[c] * scale)
            unchanged &= not moved_by_code
            d = now - old[c]
            cells.append((f"{d:+.0f}" if c in COUNTS else f"{d:+.3f}") + ("*" if moved_by_code else ""))
        if unchanged:
            same.append(label)
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    lines.append("")
    lines.append("Methods whose seeds " + ", ".join(map(str, range(seeds_before))) + " reproduce every previous mean: "
                 + (", ".join(same) if same else "none") + ".")
    return lines


def _folder(out: Path) -> dict:
    results = json.loads((out / "results.json").read_text())
    summary = (out / "summary.md").read_text().splitlines()
    date = summary[0].removeprefix("# Bench (").rstrip(")")
    command = next(line for line in summary if line.startswith("Command:")).removeprefix("Command: ").strip("`")
    settings = next(line for line in summary if line.startswith("Settings"))
    return {"results": results, "date": date, "command": command, "settings": settings}


def heldout_folders(out: Path) -> list[Path]:
    """Bench folders inside `out` (e.g. out/heldout-mod7, a held-out variant's suite) other than its runs."""
    return sorted(p for p in out.iterdir() if p.is_dir() and p.name != "runs" and (p / "results.json").exists()
                  and (p / "summary.md").exists())


def readme_section(out: Path, readme: Path, images: Path, study: str = "methods") -> str:
    """Write `study`'s table and plot from the bench folder `out` into `readme` between the study's markers
    (`markers`; the plots are copied into `images`, another study's into images/<study>): then, when present,
    what moved against the previous table (images/previous-methods.md), the claims' verdicts and those of every
    held-out variant's bench folder inside `out`. Returns the section."""
    f = _folder(out)
    results = f["results"]
    rs = [r for r in results if r["study"] == study]
    if not rs:
        raise ValueError(f"{out}: no results for study {study!r}")
    BEGIN, END = markers(study)
    prev = images / PREVIOUS
    images = images if study == "methods" else images / study
    images.mkdir(parents=True, exist_ok=True)
    base = readme.resolve().parent

    def image(src: Path, name: str) -> str:
        shutil.copy(src, images / name)
        return str((images / name).resolve().relative_to(base))

    parts = [BEGIN, f"Generated on {f['date']} by `{f['command']}`. {f['settings']}", "",
             *study_table(rs, study), "",
             f"![{study}: pass@1 against policy samples, pass@k, entropy]({image(out / f'{study}.png', f'{study}.png')})"]
    if study == "methods" and prev.exists():
        text = prev.read_text()
        m = re.search(r"seeds=(\d+)", text)
        where = prev.resolve().relative_to(base) if prev.resolve().is_relative_to(base) else prev
        parts += ["", (f"What moved against the previous table ({where}, computed before the fixes): now minus then, "
                       "per cell; * where the mean over the previous run's own seeds moved too, so that something "
                       "other than the added seed moved it: the code, or the toy checkpoints (runs are deterministic "
                       "per seed and checkpoint, but the checkpoints are bootstrapped on each machine)."), "",
                  *moved_table(results, parse_table(text), int(m.group(1)) if m else 2)]
    verdicts = [v for v in claim_verdicts(results) if study == "methods" or v["name"] == study]
    if verdicts:
        parts += ["", "Claims (verdict rules in docs/bench/settings.md, fixed before the first comparison):", "",
                  *claims_table(verdicts)]
        if (out / "verdicts.png").exists():
            parts += ["", f"![claims: the arms of the verdicts]({image(out / 'verdicts.png', 'verdicts.png')})"]
    for h in (heldout_folders(out) if study == "methods" else []):
        hf = _folder(h)
        hv = claim_verdicts(hf["results"])
        if not hv:
            continue
        toy = next((r.get("toy") for r in hf["results"] if r.get("toy")), h.name)
        parts += ["", (f"Held-out variant `{toy}`, run once after the above by `{hf['command']}` ({hf['date']}). "
                       f"{hf['settings']}"), "", *claims_table(hv)]
        if (h / "verdicts.png").exists():
            parts += ["", f"![claims on {toy}]({image(h / 'verdicts.png', f'verdicts-{toy}.png')})"]
    parts.append(END)
    section = "\n".join(parts)
    text = readme.read_text()
    if BEGIN in text and END in text:
        text = text[: text.index(BEGIN)] + section + text[text.index(END) + len(END):]
    else:
        text = text.rstrip("\n") + "\n\n" + section + "\n"
    readme.write_text(text)
    return section


def claims_plot(results: list[dict], verdicts: list[dict], path: Path) -> Path:
    """One panel per claim: its arms' primary metric (mean and 95% interval over seeds)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, max(len(verdicts), 1), figsize=(4.6 * max(len(verdicts), 1), 3.6), squeeze=False)
    for ax, v in zip(axes[0], verdicts):
        spec = CLAIMS[v["name"]]
        metric, A = spec["metric"], spec["arms"]
        if v["name"] == "intensity":
            pts = [(ci95(arm(results, lab, "offpolicy_guided"))[0], *ci95(arm(results, lab, metric))) for lab in A.values()]
            pts = [(0.0 if math.isnan(x) else x, m, h) for x, m, h in pts]
            ax.errorbar([p[0] for p in pts], [p[1] for p in pts], yerr=[p[2] for p in pts], marker="o", capsize=3)
            ax.set(xlabel="off-policy tokens of guided rollouts", ylabel=metric)
        elif v["name"] == "lag":
            for m in ("grpo", "oapl"):
                ys = [ci95(arm(results, A[f"{m}{L}"], metric)) for L in LAGS]
                ax.errorbar(list(LAGS), [y[0] for y in ys], yerr=[y[1] for y in ys], marker="o", capsize=3, label=m)
            ax.set(xlabel="sync.every (lag)", ylabel=metric, xscale="log")
            ax.legend(fontsize=7)
        else:
            labs = list(A.values())
            ys = [ci95(arm(results, lab, metric)) for lab in labs]
            ax.bar(range(len(labs)), [y[0] for y in ys], yerr=[y[1] for y in ys], capsize=3)
            ax.set_xticks(range(len(labs)), labs, rotation=20, fontsize=7)
            ax.set(ylabel=metric)
        ax.set_title(f"{v['name']}: {v['verdict']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


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
                from composer.runtime.report import metric_name

                xs, ys = _curve(logs, metric_name(f"pass@1/{tier}"))  # metrics.csv's name of pass@1/<tier>
                used = [samples_before(rows) for rows in logs]  # what each seed had sampled when it evaluated
                ax.plot([statistics.fmean(u.get(x, x * per_step) for u in used) for x in xs], ys, marker=".",
                        label=label)
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


def samples_before(rows: list[dict]) -> dict[int, float]:
    """{step: policy samples the run had drawn before that step's update} from its metrics rows
    (cost/policy_samples is cumulative and logged after the step's rollout, while an evaluation in a step's row
    is of the weights before it): InT's stage 1 spends its attempts, proposals and continuations at its first
    step. Empty for a log without the column."""
    out, before = {}, 0.0
    if not any(r.get("cost/policy_samples") not in (None, "") for r in rows):
        return out
    for r in sorted(rows, key=lambda r: int(r["step"])):
        out[int(r["step"])] = before
        if r.get("cost/policy_samples") not in (None, ""):
            before = float(r["cost/policy_samples"])
    return out


def _curve(runs: list[list[dict]], key: str) -> tuple[list[float], list[float]]:
    """Mean over seeds of a metric against step (steps where every seed has it)."""
    per = [{int(r["step"]): float(r[key]) for r in rows if r.get(key) not in (None, "")} for rows in runs]
    steps = sorted(set.intersection(*[set(p) for p in per])) if per else []
    return steps, [statistics.fmean(p[s] for p in per) for s in steps]


def _run_name(v: Variant) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in f"{v.study}-{v.label}").strip("-_")


def _previous(out: Path, cfg: dict) -> list[dict]:
    """The results already in `out` that were run under the same settings (all but the seed count) and toy variant."""
    from components.tasks.toy import variant as toy_variant

    path = out / "results.json"
    if not path.exists():
        return []
    try:
        old = json.loads(path.read_text())
    except ValueError:
        return []
    same = {k: cfg[k] for k in cfg if k not in ("seeds", "toy")}
    return [r for r in old if r.get("settings") == same and r.get("toy", "mod10") == toy_variant()]


def _ordered(rows: list[dict]) -> list[dict]:
    """Studies and variants in suite order (others in order of appearance), seeds ascending."""
    first: dict = {}
    for r in rows:
        first.setdefault((r["study"], r["label"]), len(first))
    studies = {s: i for i, s in enumerate(SUITE)}
    labels = {(s, lab): i for s, items in SUITE.items() for i, (lab, _spec, _ov) in enumerate(items)}

    def key(r):
        sk = (r["study"], r["label"])
        return (studies.get(r["study"], len(studies)), labels.get(sk, len(labels) + first[sk]), first[sk], r["seed"])

    return sorted(rows, key=key)


def _commands(out: Path, command: str) -> str:
    """The folder's earlier command(s) and this one, when this run adds to results already there."""
    try:
        before = next(line for line in (out / "summary.md").read_text().splitlines() if line.startswith("Command:"))
    except (OSError, StopIteration):
        return command
    before = before.removeprefix("Command: ").strip("`")
    return before if command in before.split("`, then `") else f"{before}`, then `{command}"


def finished_runs(out: Path) -> dict[str, dict]:
    """The finished runs of the bench folder `out` (their result.json), by run key."""
    found = {}
    for path in sorted((out / "runs").glob("*/seed*/result.json")):
        try:
            r = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(r, dict) and r.get("key"):
            found.setdefault(r["key"], r)
    return found


def run_or_reuse(v: Variant, seed: int, out: Path, cfg: dict, done: dict, log=print, matched: dict | None = None) -> dict:
    """One run of the bench folder `out`: the finished one with the same key (in `done`), else run it into
    out/runs/<study-label>/seed<N> and keep its result.json there. `matched`: the result of the same seed of the
    arm this one is matched to (MATCHED): the run's budget is what that run used (`policy_samples_used`)."""
    from components.tasks.toy import variant as toy_variant

    cfg = {**cfg, "toy": cfg.get("toy") or toy_variant()}
    settings = {k: cfg[k] for k in cfg if k not in ("seeds", "toy")}  # the bench's, the same for matched arms
    if matched is not None:
        used = matched.get("policy_samples_used", float("nan"))
        if not isinstance(used, (int, float)) or math.isnan(used) or used <= 0:
            raise ValueError(f"{v.label} seed {seed} is matched to {matched['label']}, whose run counted no policy "
                             "samples (cost/policy_samples): rerun it with this version")
        cfg = {**cfg, "budget_samples": round(used), "matched_to": matched["label"]}
    key = json.dumps(run_key(v, seed, cfg), sort_keys=True)
    if key in done:
        log(f"[bench] {v.label} seed {seed}: same run as {done[key]['label']} ({done[key]['study']})")
        return {**done[key], "label": v.label, "study": v.study}
    log(f"[bench] {v.label} seed {seed} ..." + (f" ({cfg['budget_samples']} policy samples: what {matched['label']} "
                                                f"seed {seed} used)" if matched is not None else ""))
    folder = out / "runs" / _run_name(v) / f"seed{seed}"
    if folder.exists():  # an unfinished run (killed): start it again
        shutil.rmtree(folder)
    r = {**run_one(v, seed, folder, cfg), "settings": settings, "key": key, "budget_samples": cfg["budget_samples"],
         "matched_to": cfg.get("matched_to", "")}
    (folder / "result.json").write_text(json.dumps(r, indent=1, default=str))
    done[key] = r
    log(f"[bench] {v.label} seed {seed}: pass@1 {MIDDLE} {r.get('pass@1/' + MIDDLE, float('nan')):.3f}, "
        f"{HARD} {r.get('pass@1/' + HARD, float('nan')):.3f} ({r['wall_s']} s)")
    return r


def bench(variants: list[Variant], out: Path, cfg: dict, command: str, log=print, seeds=None) -> list[dict]:
    """Run every variant for each seed (`seeds`, default range(cfg['seeds'])) and write the outputs.

    A run that two studies share (same spec, overrides, seed, settings and toy variant) runs once; a run whose
    folder already holds its finished result (`result.json` with the same key) is not run again, so a suite
    can be continued or given more seeds in place. Results of other studies already in `out` under the same
    settings are kept in results.json and summary.md."""
    from components.tasks.toy import DEFAULT_VARIANT, VARIANT_ENV
    from components.tasks.toy import variant as toy_variant

    cfg = {**cfg, "toy": toy_variant()}
    if cfg["toy"] != DEFAULT_VARIANT and VARIANT_ENV not in command:
        command = f"{VARIANT_ENV}={cfg['toy']} {command}"  # how to run it again
    seeds = list(range(cfg["seeds"])) if seeds is None else list(seeds)
    mine = {(v.study, v.label) for v in variants}
    kept = [r for r in _previous(out, cfg) if (r["study"], r["label"]) not in mine or r["seed"] not in seeds]
    command = command if not kept else _commands(out, command)
    results = []
    done = finished_runs(out)  # key -> result: the same spec, overrides, seed and settings run once
    # the arms others are matched to (MATCHED) run first: the others' budgets are what they used
    pairs = sorted(((v, seed) for v in variants for seed in seeds), key=lambda p: MATCHED.get(p[0].study) != p[0].label)
    for i, (v, seed) in enumerate(pairs):
        ran = len(done)
        src = MATCHED.get(v.study)
        matched = None
        if src and v.label != src:
            matched = next((r for r in results if (r["study"], r["label"], r["seed"]) == (v.study, src, seed)), None)
            if matched is None:
                raise ValueError(f"study {v.study!r}: {v.label} is matched to {src!r}, which is not among the arms run")
        results.append(run_or_reuse(v, seed, out, cfg, done, log, matched))
        if len(done) > ran or i == len(pairs) - 1:  # after every new run, and at the end
            merged = _ordered(kept + results)
            write_outputs(merged, out, cfg, command)
            (out / "results.json").write_text(json.dumps(merged, indent=1, default=str))
    return results


def extend_seeds(out: Path, labels: list[str], seeds: int = EXTRA_SEEDS, cfg: dict | None = None, log=print,
                 command: str | None = None) -> list[dict]:
    """The pre-registered extension: give the `claims` arms `labels` seeds up to `seeds` in the bench folder
    `out` (earlier seeds are reused from their folders)."""
    out, cfg = Path(out), dict(cfg or DEFAULTS)
    variants = [Variant(label, spec, list(ov), study="claims") for label, spec, ov in SUITE["claims"] if label in labels]
    missing = set(labels) - {v.label for v in variants}
    if missing:
        raise ValueError(f"not arms of the claims study: {', '.join(sorted(missing))}")
    command = command or f"composer.bench.methods.extend_seeds({str(out)!r}, {sorted(labels)!r}, {seeds})"
    return bench(variants, out, {**cfg, "seeds": seeds}, command, log=log)
