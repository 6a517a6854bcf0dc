"""The referee's checks (DESIGN.md section 10): each quantity recomputed from the spec (per segment, by the Plan)
and the recorded inputs, with formulas written here (never the component's helpers).

A check is a named row of a Report: how many times it held, how many it failed, the first failure. A check that
saw nothing it needed to see (no gate row, no moved weight, no kept group, nothing parsed, an EMA teacher that
never differed from its start) fails with the counts: a check that cannot fail is no check.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from composer.origins import CODE
from composer.referee.record import GUIDE_ORIGINS, TOL, fresh_logprobs, row_key, segment_spec
from composer.stops import of

KL_TOL = 0.05  # the KL term's gradient, per unit of kl_coef x token weight (a check of its own)
NOISE = 5e-5  # float32 forward passes of the same weights, shapes apart (a teacher prompt with its context)


@dataclass
class Check:
    name: str
    passed: int = 0
    failed: int = 0
    first: str = ""
    note: str = ""


@dataclass
class Report:
    spec: str = ""
    checks: dict = field(default_factory=dict)

    def expect(self, name: str, ok: bool, msg: str = "") -> bool:
        c = self.checks.setdefault(name, Check(name))
        if ok:
            c.passed += 1
        else:
            c.failed += 1
            c.first = c.first or msg
        return bool(ok)

    def note(self, name: str, text: str) -> None:
        self.checks.setdefault(name, Check(name)).note = text

    @property
    def ok(self) -> bool:
        return not any(c.failed for c in self.checks.values())

    def failures(self) -> list[str]:
        return [f"{c.name}: {c.first} ({c.failed} failed, {c.passed} passed)" for c in self.checks.values() if c.failed]

    def table(self) -> str:
        w = max([len(c) for c in self.checks] + [5])
        out = [f"referee: {self.spec}", f"  {'check'.ljust(w)}  result  pass  fail  detail"]
        for c in self.checks.values():
            res = "FAIL" if c.failed else ("ok" if c.passed else "-")
            out.append(f"  {c.name.ljust(w)}  {res:6}  {c.passed:4}  {c.failed:4}  {c.first or c.note}")
        bad = sum(1 for c in self.checks.values() if c.failed)
        out.append(f"{len(self.checks) - bad} checks passed, {bad} failed")
        return "\n".join(out)


# ----------------------------------------------------------------------------------------------- the plan

def segment_of(plan: dict, step: int) -> dict:
    return next(s for s in plan["segments"] if s["start"] <= step < s["end"])


def expected_syncs(plan: dict) -> list[int]:
    """Optimiser steps after which the rollout weights refresh: every sync.every steps counted from each
    segment's start, and at the end of every stage (the next stage starts from its final weights)."""
    out = []
    segs = plan["segments"]
    for k, seg in enumerate(segs):
        every = seg["sync"]["every"]
        out += [d for d in range(seg["start"] + 1, seg["end"] + 1) if (d - seg["start"]) % every == 0]
        nxt = segs[k + 1] if k + 1 < len(segs) else None
        if nxt is not None and nxt.get("stage") != seg.get("stage") and seg["end"] not in out:
            out.append(seg["end"])
    return sorted(set(d for d in out if d <= plan["total_steps"]))


def stage_start(plan: dict, spec, step: int) -> int:
    """The step whose starting weights are the reference of `step`: its stage's first step (the run's
    start without stages or with train.reference: run_start), or the last periodic reset at or before `step`
    (train.reset_every steps of the segment, counted from its start, with `reference` in reset_what)."""
    seg = segment_of(plan, step)
    start = 0
    if seg.get("stage") is not None and spec.train.reference != "run_start":
        start = min(s["start"] for s in plan["segments"] if s.get("stage") == seg["stage"])
    t = spec.train
    if t.reset_every and "reference" in t.reset_what:
        start = max(start, seg["start"] + (step - seg["start"]) // t.reset_every * t.reset_every)
    return start


def loss_origins(plan: dict, step: int, term: str) -> tuple:
    seg = segment_of(plan, step)
    t = next(t for t in seg["token_origins"] if t["term"] == term)
    return tuple(o for o, x in t["origins"].items() if x["loss"])


# ----------------------------------------------------------------------------------------------- rows

def _groups(group: list) -> dict:
    out: dict = {}
    for i, g in enumerate(group):
        out.setdefault(g, []).append(i)
    return out


def _std(xs: list) -> float:
    m = sum(xs) / len(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1)) if len(xs) > 1 else 0.0


def _quantile(xs: list, q: float) -> float:
    """Linear interpolation between order statistics (numpy's default)."""
    s = sorted(xs)
    pos = q * (len(s) - 1)
    lo = int(math.floor(pos))
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def gate_select(gate, success: list, group: list, surprisal: list | None) -> list:
    """The rows a gate selects, from its declared conditions (composer/gates.py's contract, written again)."""
    out = []
    members = _groups(group)
    for i in range(len(success)):
        rows = members[group[i]]
        rate = sum(success[j] for j in rows) / len(rows)
        sib = any(success[j] for j in rows if j != i)
        ok = True
        if gate.outcome is not None:
            ok = ok and success[i] == (gate.outcome == "success")
        if gate.group_success_at_most is not None:
            ok = ok and rate <= gate.group_success_at_most + 1e-9
        if gate.group_success_above is not None:
            ok = ok and rate > gate.group_success_above + 1e-9
        if gate.sibling_success is not None:
            ok = ok and sib == gate.sibling_success
        if gate.entropy_above_quantile is not None:
            ok = ok and surprisal[i] >= _quantile(surprisal, gate.entropy_above_quantile)
        if gate.entropy_below_quantile is not None:
            ok = ok and surprisal[i] < _quantile(surprisal, gate.entropy_below_quantile)
        out.append(bool(ok))
    return out


def declared_gate_source(gate, spec) -> str | None:
    if gate.source is not None:
        return gate.source
    names = [n for n, s in spec.sources.items() if s.kind_name() == "outcome_reward"]
    return names[0] if len(names) == 1 else None


def declared_filter_source(flt, spec) -> str | None:
    from composer.checks.terms import terms

    if flt.source is not None:
        return flt.source
    for _n, sig, _o, _w in terms(spec):
        if sig is not None and sig.kind_name() == "reward":
            return sig.source
    names = [n for n, s in spec.sources.items() if s.kind_name() == "outcome_reward"]
    return names[0] if len(names) == 1 else None


def verdict_rewards(rec, spec, source: str, b) -> list | None:
    """The verifier's rewards of b's rows (as it returned them in the run); None if a row has none (or the source is
    no verifier)."""
    verifier = getattr(spec.sources[source], "verifier", None)
    if verifier is None:
        return None
    out = []
    for i in range(b.size):
        got = rec.verdicts.get((verifier, row_key(b, i)))
        if got is None:
            return None
        out.append(got[0])
    return out


def source_rewards(rec, spec, source: str, b, step: int | None) -> list | None:
    """The rewards source `source` gives b's rows: a verifier's verdicts as it returned them, or a reward model's
    score recomputed by a fresh forward of its checkpoint (composer/referee/critic.py); None when not recomputable."""
    if spec.sources[source].kind_name() == "reward_model":
        from composer.referee.critic import reward_model_rewards

        return None if step is None else reward_model_rewards(rec, step, source, b)
    return verdict_rewards(rec, spec, source, b)


def expected_rewards(rec, spec, sig, b, task_cap, step: int | None = None) -> tuple[list, int] | None:
    """r_i of a `reward` signal recomputed: its source's reward of row i (a verifier's verdict, or a reward model's
    score) plus sum_k w_k part_k(i) over its `plus` parts: another verifier's verdict or reward model's score; DAPO's
    overlong penalty (Yu et al. 2025, eq. 13) -factor * clip(|o_i| - (L_max - L_cache), 0, L_cache) / L_cache with
    L_max = max_tokens or the run's response cap (rollout.max_new_tokens, at most the task's) and
    L_cache = min(buffer, L_max); a length penalty -coef |o_i|.
    -> (r [B], how many rows a part changed); None where a verdict is missing or a part is a plugin's."""
    out = source_rewards(rec, spec, sig.source, b, step)
    if out is None:
        return None
    base = list(out)
    lengths = b.response_mask.sum(-1).tolist()
    for name, w in sig.plus.items():
        src = spec.sources[name]
        kind = src.kind_name()
        if kind in ("outcome_reward", "reward_model"):
            part = source_rewards(rec, spec, name, b, step)
        elif kind == "overlong_penalty":
            n = spec.rollout.max_new_tokens
            cap = src.max_tokens or (min(n, task_cap) if task_cap else n)
            buf = min(src.buffer, cap)
            part = [-src.factor * min(max(ln - (cap - buf), 0), buf) / buf for ln in lengths]
        elif kind == "length_penalty":
            part = [-src.coef * ln for ln in lengths]
        else:
            return None
        if part is None:
            return None
        out = [r + w * p for r, p in zip(out, part)]
    return out, sum(1 for r, r0 in zip(out, base) if r != r0)


def truncated(b, eos_id) -> list:
    """Rows whose response does not end in a stop token (`eos_id`: one id, or the stop tokens, composer/stops.py)."""
    stops = {eos_id} if isinstance(eos_id, int) else set(eos_id)
    out = []
    for i in range(b.size):
        pos = b.response_mask[i].nonzero().flatten().tolist()
        out.append(not pos or int(b.tokens[i, pos[-1]]) not in stops)
    return out


def surprisal(b) -> list:
    """Mean -log pi_behaviour over each row's sampled policy tokens (0 for a row without one)."""
    m = (b.origin == CODE["policy"]) & b.known_mask
    out = []
    for i in range(b.size):
        lp = b.behavior_logprobs[i][m[i]].double()
        out.append(float(-lp.sum() / max(int(m[i].sum()), 1)))
    return out


def expected_control(spec, b, tokenizer=None) -> list:
    """Control rows from the spec: an intervention guide's first `control_samples` rollouts of each prompt
    (rows are written prompt by prompt, samples_per_prompt each); a prefix guide's rows without a prefix (placed
    in the response: no guide_prefix token; placed in the prompt (POPE): the prompt shows no step of the row's
    reference solution, read off the row's example and its decoded prompt); a traces guide's rows other than a
    prompt's first `per_group` (and those when a reference has no text for the problem); with no guide every row."""
    guide = spec.rollout.guide
    kind = guide.kind_name()
    n = spec.rollout.samples_per_prompt
    if kind == "intervention":
        return [i % n < guide.control_samples for i in range(b.size)]
    if kind == "traces":
        return [not (i % n < guide.per_group and declared_trace(spec, _example(b, i)) is not False)
                for i in range(b.size)]
    if kind == "none":
        return [True] * b.size
    if getattr(guide, "placement", "response") == "prompt" and tokenizer is not None:
        prompts = b.mask(("prompt",)) & b.attention_mask.bool()
        out = []
        for i in range(b.size):
            ex = b.examples[i] if len(b.examples) == b.size else b.examples[int(b.prompt_index[i])]  # one per row
            first = next((s for s in (ex.solution or "").split("\n") if s.strip()), None)
            text = tokenizer.decode(b.tokens[i][prompts[i]].tolist(), skip_special_tokens=True)
            out.append(first is None or first not in text.replace(ex.problem or "\0", ""))
        return out
    return [not bool(b.mask(("guide_prefix",))[i].any()) for i in range(b.size)]


def expected_prefix_steps(spec, ex, step: int, n_ref: int) -> tuple[int, int]:
    """The prefix a prefix guide (POPE, PrefixRL) must show row example `ex` at `step`, from the spec alone:
    (k_min, k_max) of reference steps. Not chosen (sha256(prompt|step|seed) / 16^8 >= guided_fraction): (0, 0).
    Chosen: at most floor(max_fraction n), never the whole reference; `fixed` exactly that; `random` the hashed
    draw between ceil(min_fraction n) and it; `minimal` any k from 0 (the initial policy needs none) to it.
    Units are the guide's: reference steps, or tokens (`unit: tokens`)."""
    import hashlib

    g = spec.rollout.guide
    seed = spec.train.seed
    chosen = int(hashlib.sha256(f"{ex.prompt}|{step}|{seed}".encode()).hexdigest()[:8], 16) / 16 ** 8 < g.guided_fraction
    if not chosen:
        return 0, 0
    kmax = max(0, min(math.floor(g.max_fraction * n_ref), n_ref - 1))
    if g.search == "fixed":
        return kmax, kmax
    if g.search == "random":
        kmin = min(math.ceil(g.min_fraction * n_ref), kmax)
        u = int(hashlib.sha256(f"{ex.prompt}|{step}|{seed}|k".encode()).hexdigest()[:8], 16) / 16 ** 8
        k = kmin + min(int(u * (kmax - kmin + 1)), kmax - kmin)
        return k, k
    return 0, kmax


def shown_prefix_steps(text: str, steps: list[str], sep: str) -> int:
    """How many of the reference's first steps `text` shows, in order, each followed by the separator (0: none)."""
    k = 0
    while k < len(steps) and (sep.join(steps[: k + 1]) + sep) in text:
        k += 1
    return k


def _example(b, i: int):
    return b.examples[i] if len(b.examples) == b.size else b.examples[int(b.prompt_index[i])]


# ----------------------------------------------------------------------------------------------- traces

def declared_trace(spec, example):
    """What the traces guide declares for a trace row of `example`: the reference text (a reference_solution source:
    its `field` of the data row when set, else the row's solution; False when there is none, the row is then the
    policy's rollout) or None (a policy_model source writes it: checked against what that model generated)."""
    src = spec.sources[spec.rollout.guide.source]
    if src.kind_name() == "policy_model":
        return None
    field = getattr(src, "field", None)
    text = example.meta.get(field) if field and example.meta.get(field) is not None else example.solution
    return str(text) if text else False


def check_traces(rep, rec, v, events) -> None:
    """The traces guide, from the spec: in each recorded rollout (rows prompt by prompt, samples_per_prompt each) the
    first per_group rows of a prompt are traces: every response token `demonstration`, the tokens the reference's
    text + EOS (cut at the rollout's response budget) or a continuation the declared writer generated after that
    very prompt; the other rows hold no demonstration token. In every trained batch each advantage group holds one
    prompt's n rows with its k traces (the mixed group), never the traces apart."""
    from composer.checks.terms import terms

    seen = 0
    written = set(rec.written)
    for kind, e in events:
        spec = segment_spec(v, e["segment"])
        if spec.rollout.guide.kind_name() != "traces":
            continue
        g = spec.rollout.guide
        n, k = spec.rollout.samples_per_prompt, g.per_group
        if kind == "rollout":
            b, tok = e["batch"], rec.tokenizer
            for i in range(b.size):
                resp = b.response_mask[i]
                origins = set(b.origin[i][resp].tolist())
                want = declared_trace(spec, _example(b, i)) if i % n < k else False
                if i % n >= k or want is False:
                    rep.expect("trace rows as declared", CODE["demonstration"] not in origins,
                               f"step {e['step']} row {i}: a rollout row (sample {i % n} of {n}) carries trace tokens")
                    continue
                got = b.tokens[i][resp].tolist()
                prompt = b.tokens[i][b.origin[i] == CODE["prompt"]].tolist()
                ok = origins == {CODE["demonstration"]}
                if want is None:  # written by the declared policy_model source after this prompt
                    ok = ok and (g.source, tuple(prompt), tuple(got)) in written
                    what = f"a generation of '{g.source}' after the row's prompt"
                else:
                    full = tok.encode(want, add_special_tokens=False) + [of(tok).end]  # composer/stops.py
                    room = e.get("room") or len(full)
                    ok = ok and got == full[:room]
                    what = f"the reference text + EOS cut at {room} tokens ({min(room, len(full))} tokens)"
                seen += 1
                rep.expect("trace rows as declared", ok, f"step {e['step']} row {i}: sample {i % n} of {n} must be "
                           f"{what}, all demonstration tokens; got {len(got)} tokens of origins {sorted(origins)}")
        elif kind == "term_loss" and e["batch"].rewards is not None and any(
                n_ == e["term"] and not s_.makes_batch for n_, s_, _o, _w in terms(spec)):
            b = e["batch"]
            for rows in _groups(b.group.tolist()).values():
                traces = sum(bool((b.origin[i] == CODE["demonstration"]).any()) for i in rows)
                ex = _example(b, rows[0])
                want = k if declared_trace(spec, ex) is not False else 0
                rep.expect("mixed groups as declared", len(rows) == n and traces == want,
                           f"step {e['step']} {e['term']}: a group of {len(rows)} rows with {traces} traces; the spec "
                           f"declares {n} rows of one prompt with {want} traces among them")
    if any(seg.spec.rollout.guide.kind_name() == "traces" for seg in v.segments):
        rep.expect("saw trace rows", seen > 0, "no trace row checked: nothing tested the traces guide")


# ----------------------------------------------------------------------------------------------- advantages

GRADIENTS: dict = {}  # objective kind -> f(objective, batch, mask, cur, old, ref, adv) -> parts


def gradient(kind: str):
    def deco(fn):
        GRADIENTS[kind] = fn
        return fn
    return deco


# ----------------------------------------------------------------------------------------------- losses

def _token_weights(mask, agg: str):
    """[B, T] d(aggregate)/d(loss_t); None for an aggregation this referee does not cover."""
    import torch

    m = mask.double()
    if agg == "token-mean":
        return m / m.sum().clamp(min=1)
    if agg == "seq-mean-token-mean":
        n = m.sum(-1, keepdim=True)
        rows = float((n > 0).sum())
        return torch.where(n > 0, m / n.clamp(min=1), torch.zeros_like(m)) / max(rows, 1.0)
    return None


def grpo_formula_covers(obj) -> bool:
    """Token ratio, PPO clip without dual clip, token-mean or seq-mean-token-mean (the others: by hand in
    tests/test_methods_runs.py and against TRL in tests/test_trl_parity.py)."""
    return (getattr(obj, "ratio", "token") == "token" and getattr(obj, "bound", "clip") == "clip"
            and getattr(obj, "dual_clip", None) is None and obj.loss_agg in ("token-mean", "seq-mean-token-mean"))


def covered(obj) -> bool:
    return obj.kind_name() in GRADIENTS and (obj.kind_name() != "grpo" or grpo_formula_covers(obj))


def kl_formula(d, estimator: str):
    """(value, d value / d lp) per token of the KL estimators at d = lp - lp_ref (ALGORITHMS.md section 0):
    k1 = d, k2 = d^2 / 2, k3 = exp(-d) + d - 1 with verl's low_var_kl clamps (d to +-20, the value to +-10): where
    a clamp binds the token's KL has no gradient (a policy 2.7 nats below its reference on a token: k3 > 10)."""
    import torch

    if estimator == "k1":
        return d, torch.ones_like(d)
    if estimator == "k2":
        return 0.5 * d * d, d
    dc = d.clamp(-20.0, 20.0)
    k3 = torch.exp(-dc) + dc - 1
    free = (d.abs() <= 20.0) & (k3.abs() <= 10.0)
    return k3.clamp(-10.0, 10.0), torch.where(free, 1 - torch.exp(-dc), torch.zeros_like(d))


@gradient("grpo")
def grpo_parts(obj, b, mask, cur, old, ref, adv, kl_coef):
    """GRPO's clipped surrogate and KL, per token: rho_t = exp(lp_t - lp_old_t),
    l_t = -min(rho A, clip(rho) A), dl/dlp = -A rho where the clip does not bind; + kl_coef k(lp - lp_ref).
    -> dict(w, pg_value, pg_grad, kl_value, kl_grad) [B, T] (None when not covered)."""
    import torch

    if not grpo_formula_covers(obj):
        return None
    sel = None
    kind = selection_kind(obj)
    if kind is not None:
        if not whole_step(b, mask):  # a mini-batch of the step: the statistic is the whole step's
            return None
        sel = (referee_selection(obj, b, mask, adv)[0] if kind == "kl_cov"  # recomputed: the top k N by Cov_t
               else b.token_select.cpu() & mask)  # a random draw: its tokens checked by check_token_selection
    w = _token_weights(mask, obj.loss_agg)
    lo = obj.clip if obj.clip_low is None else obj.clip_low
    hi = obj.clip if obj.clip_high is None else obj.clip_high
    A = torch.tensor(adv, dtype=torch.float64)[:, None]
    rho = torch.exp(cur.double() - old.double())
    form = getattr(getattr(obj, "off_policy_weight", None), "kind", "none")
    off = torch.zeros_like(mask)  # loss tokens the policy did not write, under the declared weight form
    if form != "none":
        for o in ("guide_prefix", "guide_intervention", "demonstration"):
            off |= mask & (b.origin.cpu() == CODE[o])
    clipped = rho.clamp(1 - lo, 1 + hi)
    inside = (rho >= 1 - lo) & (rho <= 1 + hi)
    unclipped_min = rho * A <= clipped * A
    pg_tok = -torch.minimum(rho * A, clipped * A)
    pg_grad = torch.where(inside | unclipped_min, -A * rho, torch.zeros_like(rho))
    if kind == "kl_cov":  # l_t = -A rho + beta |log rho|; d/dlp = -A rho + beta sign(log rho)
        d = cur.double() - old.double()
        beta = obj.token_selection.beta
        pg_tok = torch.where(sel, -A * rho + beta * d.abs(), pg_tok)
        pg_grad = torch.where(sel, -A * rho + beta * torch.sign(d), pg_grad)
    elif kind == "clip_cov":  # l_t = 0: no loss, no gradient (the token still counts in the normaliser)
        pg_tok = torch.where(sel, torch.zeros_like(pg_tok), pg_tok)
        pg_grad = torch.where(sel, torch.zeros_like(pg_grad), pg_grad)
    if form != "none":  # tokens the policy did not write: l = -A f(pi), no ratio, no clip; d l / d lp = -A f'(pi) pi
        f, df = off_policy_formula(obj.off_policy_weight, cur.double())
        pg_tok = torch.where(off, -A * f, pg_tok)
        pg_grad = torch.where(off, -A * df, pg_grad)
    out = {"w": w, "pg_value": float((w * pg_tok * mask).sum()), "pg_grad": w * pg_grad * mask,
           "kl_value": 0.0, "kl_grad": torch.zeros_like(rho)}
    if kl_coef > 0 and ref is not None:  # on the policy's own tokens (an estimate from its samples)
        d = torch.where(mask, cur.double() - ref.double(), torch.zeros_like(rho))
        val, dk = kl_formula(d, obj.kl_estimator)
        on = mask & ~off
        out["kl_value"] = float((w * val * on).sum())
        out["kl_grad"] = w * dk * on
    return out


def off_policy_formula(form, lp):
    """(f, d f / d lp) per token of the declared weight form of tokens the policy did not write, at pi = exp(lp):
    shaped f = pi / (pi + gamma), f' pi = gamma pi / (pi + gamma)^2 (LUFFY); prob f = pi; pow f = pi^alpha,
    alpha pi^alpha; log f = lp, 1."""
    import torch

    pi = torch.exp(lp)
    if form.kind == "shaped":
        return pi / (pi + form.gamma), form.gamma * pi / (pi + form.gamma) ** 2
    if form.kind == "prob":
        return pi, pi
    if form.kind == "pow":
        return pi ** form.alpha, form.alpha * pi ** form.alpha
    if form.kind == "log":
        return lp, torch.ones_like(lp)
    raise ValueError(f"the referee has no formula for off_policy_weight {form.kind}")


# ----------------------------------------------------------------------------------------------- token selection

def selection_kind(obj) -> str | None:
    """grpo's token_selection kind when it selects (kl_cov, clip_cov), else None."""
    sel = getattr(obj, "token_selection", None)
    return None if sel is None or sel.kind == "none" else sel.kind


def whole_step(b, mask) -> bool:
    """b holds the whole step's loss tokens: as many as the run's selection counted over the step (a mini-batch of
    the step holds fewer; check_token_selection checks the count itself on every whole batch)."""
    return b.token_select is not None and float(b.info.get("token_selection/tokens", -1)) == float(mask.sum())


def referee_covariance(b, mask, adv: list):
    """Cov_t = (lp_t - mean lp)(A_t - mean A) over the step's loss tokens (row-major), lp the behaviour log-prob the
    step starts with, A_t the referee's advantage of the token's row; float64 -> (cov [N], the [B, T] mask)."""
    import torch

    m = mask.cpu().bool()
    lp = b.behavior_logprobs.detach().cpu().double()[m]
    a = torch.tensor(adv, dtype=torch.float64)[:, None].expand(m.shape)[m]
    if lp.numel() == 0:
        return lp, m
    return (lp - lp.sum() / lp.numel()) * (a - a.sum() / a.numel()), m


def referee_selection(obj, b, mask, adv: list):
    """The selection recomputed from the spec: kl_cov the max(1, floor(k N)) largest Cov_t (ties by position);
    clip_cov the band omega_low < Cov_t < omega_high and the count min(max(1, floor(r N)), band size) a draw must
    have. -> ([B, T] bool: kl_cov the tokens, clip_cov the band; the count; cov [N]; mask)."""
    import torch

    cov, m = referee_covariance(b, mask, adv)
    n = cov.numel()
    sel = obj.token_selection
    out = torch.zeros(m.shape, dtype=torch.bool)
    flat = torch.zeros(n, dtype=torch.bool)
    if sel.kind == "kl_cov":
        count = max(1, int(n * sel.k)) if n else 0
        order = sorted(range(n), key=lambda i: (-float(cov[i]), i))
        flat[order[:count]] = True
    else:
        flat = (cov > sel.omega_low) & (cov < sel.omega_high)
        count = min(max(1, int(sel.r * n)) if n else 0, int(flat.sum()))
    out[m] = flat
    return out, count, cov, m


def check_token_selection(rep, term_events) -> None:
    """KL-Cov / Clip-Cov (grpo.token_selection): on every batch that holds a whole step, the run's step count N, and
    its selection against the one recomputed from the spec: kl_cov the same top k N tokens (a token may differ only
    at a tie of Cov_t, within 1e-9); clip_cov the count and every token inside the band. A batch that is a mini-batch
    of its step is not covered (noted). Fails when no token was ever selected (a check that cannot fail is none)."""
    import torch

    seen = {"whole": 0, "parts": 0, "selected": 0}
    for e in term_events:
        b, obj = e["batch"], e["objective"]
        kind = selection_kind(obj)
        if kind is None or b.advantages is None:
            continue
        mask = (b.mask(obj.loss_tokens) & b.attention_mask.bool() & b.known_mask).cpu()
        if b.row_mask is not None:
            mask &= b.row_mask.cpu()[:, None]
        name = f"token selection ({kind}) recomputed"
        if b.token_select is None:
            rep.expect(name, False, f"step {e['step']} {e['term']}: the batch carries no token selection")
            continue
        if not whole_step(b, mask):
            seen["parts"] += 1
            continue
        seen["whole"] += 1
        adv = obj.reference_advantages(b.rewards.double().tolist(), b.group.tolist(), b.control.tolist(),
                                       b.mask(("policy",)).sum(-1).tolist())
        want, count, cov, m = referee_selection(obj, b, mask, adv)
        got = b.token_select.cpu() & mask
        seen["selected"] += int(got.sum())
        if kind == "kl_cov":
            differ = (want ^ got)[m]
            ok = int(got.sum()) == count
            if ok and differ.any():  # only ties at the k-th value may differ
                kth = float(torch.sort(cov, descending=True).values[count - 1])
                ok = bool(((cov[differ] - kth).abs() <= 1e-9).all())
            rep.expect(name, ok, f"step {e['step']} {e['term']}: the run selected {int(got.sum())} tokens, the top "
                       f"{count} by Cov_t differ at {int(differ.sum())}")
        else:
            outside = int((got & ~want).sum())
            rep.expect(name, int(got.sum()) == count and outside == 0,
                       f"step {e['step']} {e['term']}: the run selected {int(got.sum())} tokens ({outside} outside the "
                       f"band {obj.token_selection.omega_low:g} < Cov_t < {obj.token_selection.omega_high:g}), the "
                       f"spec's count is {count} of {int(want.sum())} in the band")
    if seen["whole"] or seen["parts"]:
        rep.expect("token selection selected tokens", seen["selected"] > 0,
                   f"no token selected in {seen['whole']} whole steps: nothing tested the selection")
        rep.note("token selection selected tokens", f"{seen['selected']} selected over {seen['whole']} whole-step "
                 f"batches; {seen['parts']} mini-batches not covered")


@gradient("advantage_regression")
def regression_parts(obj, b, mask, cur, old, ref, adv, kl_coef):
    """L = sum_i w_i (beta2 [sum_t m_t (lp_t - anchor_t)] - A_i)^2 / sum_i w_i; on a loss token of row i
    d L / d lp_t = 2 beta2 w_i (beta2 lr_i - A_i) / sum_i w_i. Anchors as declared: policy tokens the sampler's
    log-prob (reference initial: the stage-start weights'); another origin a constant kappa (Const) or the
    sampler's log-prob (Proxy)."""
    import torch

    anchor = old.double().clone()
    if obj.reference == "initial":
        anchor = torch.where(b.origin == CODE["policy"], ref.double(), anchor)
    for origin, a in obj.anchor.items():
        if not isinstance(a, str):
            anchor = torch.where(b.origin == CODE[origin], torch.full_like(anchor, float(a)), anchor)
    lr = torch.where(mask, cur.double() - anchor, torch.zeros_like(anchor)).sum(-1)
    w = (b.seq_weight.cpu() if b.seq_weight is not None else torch.ones(b.size)).double()
    A = torch.tensor(adv, dtype=torch.float64)
    coef = 2 * obj.beta2 * w * (obj.beta2 * lr - A) / w.sum()
    value = float((w * (obj.beta2 * lr - A) ** 2).sum() / w.sum())
    unit = float(w.sum()) / (2 * obj.beta2 * float(w.max()))
    return {"w": torch.full_like(anchor, 1.0 / unit), "pg_value": value, "pg_grad": coef[:, None] * mask,
            "kl_value": 0.0, "kl_grad": torch.zeros_like(anchor)}


GRADIENTS["length_penalized_grpo"] = grpo_parts  # the plugin keeps GRPO's loss


# ----------------------------------------------------------------------------------------------- teachers

def ema_weights(rec, start: int, step: int, rate: float) -> dict:
    """theta_T at `step`: the weights at `start`, then theta_T <- (1 - rate) theta_T + rate theta after every
    optimiser step (SDPO), from the recorder's copies of the policy at every step."""
    ema = {k: t.clone().double() for k, t in rec.weights_at[start].items()}
    for s in range(start + 1, step + 1):
        for k, t in rec.weights_at[s].items():
            ema[k] = (1 - rate) * ema[k] + rate * t.double()
    return {k: t.to(rec.weights_at[start][k].dtype) for k, t in ema.items()}


def teacher_state(rec, spec, plan: dict, name: str, step: int):
    """(state dict or checkpoint model, what it is) of the weights teacher `name` declares at `step`."""
    src = spec.sources[name]
    start = stage_start(plan, spec, step)
    if src.weights == "current":
        return rec.weights_at[step]
    if src.weights == "initial":
        return rec.weights_at[start]
    return ema_weights(rec, start, step, src.ema_rate)


def teacher_logprobs(model, b, prompt_ids: list, temperature: float):
    """Each row's response tokens scored by `model` after its own prompt ids (None: the row's prompt)."""
    import torch

    out = torch.zeros(b.tokens.shape)
    n_tok = b.attention_mask.sum(1).tolist()
    for i in range(b.size):
        P = int((b.origin[i] == CODE["prompt"]).sum())
        prompt = b.tokens[i, :P].tolist() if prompt_ids[i] is None else prompt_ids[i]
        seq = torch.tensor([prompt + b.tokens[i, P: n_tok[i]].tolist()])
        lp = fresh_logprobs(model, seq, torch.ones_like(seq), temperature)[0]
        out[i, P: n_tok[i]] = lp[len(prompt):]
    return out


def _max(x, m) -> float:
    return float(x.abs()[m].max()) if m.any() else 0.0
