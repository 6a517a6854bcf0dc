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
from composer.referee.record import fresh_logprobs, row_key, segment_spec
from composer.stops import of

KL_TOL = 0.05  # the KL term's gradient, per unit of kl_coef x token weight (a check of its own)
NOISE = 5e-5  # float32 forward passes of the same weights, shapes apart (a teacher prompt with its context)
ENTROPY_TOL = 1e-4  # the run's H_t (float32) against the referee's fresh forward of the same weights (float64 entropy)


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
    acted: dict = field(default_factory=dict)  # (term, part field) -> how often the part changed what trained
    checked: dict = field(default_factory=dict)  # term -> losses recomputed from its objective's reference
    v: object = None  # the validated spec the run was of (coverage lists its parts)

    def act(self, term: str, part: str, n: int) -> None:
        self.acted[(term, part)] = self.acted.get((term, part), 0) + int(n)

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


def declared_gate_source(gate, spec) -> str | None:
    if gate.source is not None:
        return gate.source
    names = [n for n, s in spec.sources.items() if type(s).decides_success]
    return names[0] if len(names) == 1 else None


def declared_filter_source(flt, spec) -> str | None:
    from composer.checks.terms import terms

    if flt.source is not None:
        return flt.source
    for _n, sig, _o, _w in terms(spec):
        if sig is not None and sig.usage == "reward":
            return sig.source
    names = [n for n, s in spec.sources.items() if type(s).decides_success]
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
    if spec.sources[source].scored_by_model:
        from composer.referee.critic import reward_model_rewards

        return None if step is None else reward_model_rewards(rec, step, source, b)
    return verdict_rewards(rec, spec, source, b)


def expected_rewards(rec, spec, sig, b, task_cap, step: int | None = None) -> tuple[list, int] | None:
    """r_i of a `reward` signal recomputed: its source's reward of row i (a verifier's verdict, or a reward model's
    score) plus sum_k w_k part_k(i) over its `plus` parts: another verifier's verdict or reward model's score; DAPO's
    part's own `reference_rewards` from the rows' response lengths and the run's response cap (rollout.max_new_tokens,
    at most the task's): DAPO's overlong penalty, a length penalty.
    -> (r [B], how many rows a part changed); None where a verdict is missing or a part has no reference."""
    out = source_rewards(rec, spec, sig.source, b, step)
    if out is None:
        return None
    base = list(out)
    lengths = b.response_mask.sum(-1).tolist()
    n = spec.rollout.max_new_tokens
    cap = min(n, task_cap) if task_cap else n  # the response cap generation ran under
    parts = {}
    for name in sig.plus:
        part = spec.sources[name].reference_rewards(lengths, cap)  # a part's own formula (its file), if it has one
        if part is None:
            part = source_rewards(rec, spec, name, b, step)
        if part is None:
            return None
        parts[name] = part
    out = sig.reference_reward(base, parts)  # the signal's own sum (its file)
    env = spec.rollout.environment
    if env.active and env.turn_reward_weight:  # the environment's per-turn rewards, from its replay (its reference)
        from composer.referee.episodes import turn_rewards

        out = [r + env.turn_reward_weight * t for r, t in zip(out, turn_rewards(env, b, rec.tokenizer))]
    return out, sum(1 for r, r0 in zip(out, base) if r != r0)


def truncated(b, eos_id, decode=None, stop_strings: tuple = ()) -> list:
    """Rows whose response does not end in a stop token (`eos_id`: one id, or the stop tokens, composer/stops.py).
    An episode's row (`decode` given: the spec declares an environment, whose turns end at `stop_strings` too) is
    cut only where its response ends in a policy turn that ends in neither a stop token nor a stop string: a row
    ending in the environment's tokens, or in a call the turn limit left unanswered, was not cut."""
    stops = {eos_id} if isinstance(eos_id, int) else set(eos_id)
    env = CODE["environment"]
    out = []
    for i in range(b.size):
        pos = b.response_mask[i].nonzero().flatten().tolist()
        if decode is None:
            out.append(not pos or int(b.tokens[i, pos[-1]]) not in stops)
            continue
        codes = [int(b.origin[i, p]) for p in pos]
        if not pos or codes[-1] == env or int(b.tokens[i, pos[-1]]) in stops:
            out.append(False)
            continue
        start = max((k + 1 for k, c in enumerate(codes) if c == env), default=0)  # the final turn's first token
        text = decode([int(b.tokens[i, p]) for p in pos[start:]])
        out.append(not any(s in text for s in stop_strings))
    return out


def surprisal(b) -> list:
    """Mean -log pi_behaviour over each row's sampled policy tokens (0 for a row without one)."""
    m = (b.origin == CODE["policy"]) & b.known_mask
    out = []
    for i in range(b.size):
        lp = b.behavior_logprobs[i][m[i]].double()
        out.append(float(-lp.sum() / max(int(m[i].sum()), 1)))
    return out


def shown_prefix_steps(text: str, steps: list[str], sep: str) -> int:
    """How many of the reference's first steps `text` shows, in order, each followed by the separator (0: none)."""
    k = 0
    while k < len(steps) and (sep.join(steps[: k + 1]) + sep) in text:
        k += 1
    return k


def _example(b, i: int):
    return b.examples[i] if len(b.examples) == b.size else b.examples[int(b.prompt_index[i])]


# ----------------------------------------------------------------------------------------------- traces

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
        g = spec.rollout.guide
        if not hasattr(g, "reference_trace"):  # a guide that puts whole traces in groups declares them
            continue
        n, k = spec.rollout.samples_per_prompt, g.per_group
        if kind == "rollout":
            b, tok = e["batch"], rec.tokenizer
            for i in range(b.size):
                resp = b.response_mask[i]
                origins = set(b.origin[i][resp].tolist())
                want = g.reference_trace(spec, _example(b, i)) if i % n < k else False
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
                want = k if g.reference_trace(spec, ex) is not False else 0
                rep.expect("mixed groups as declared", len(rows) == n and traces == want,
                           f"step {e['step']} {e['term']}: a group of {len(rows)} rows with {traces} traces; the spec "
                           f"declares {n} rows of one prompt with {want} traces among them")
    if any(hasattr(seg.spec.rollout.guide, "reference_trace") for seg in v.segments):
        rep.expect("saw trace rows", seen > 0, "no trace row checked: nothing tested the traces guide")


# ----------------------------------------------------------------------------------------------- advantages

def has_reference_loss(obj) -> bool:
    """The objective's file declares its loss again (`reference_loss`, DESIGN.md section 10)."""
    from components.objectives.base import Objective

    return type(obj).reference_loss is not Objective.reference_loss


# ----------------------------------------------------------------------------------------------- token selection

def selection_of(obj):
    """The objective's token selection when one acts (KL-Cov, Clip-Cov: grpo.token_selection), else None."""
    sel = getattr(obj, "token_selection", None)
    return sel if sel is not None and type(sel).acts else None


def whole_step(b, mask) -> bool:
    """b holds the whole step's loss tokens: as many as the run's selection counted over the step (a mini-batch of
    the step holds fewer; check_token_selection checks the count itself on every whole batch)."""
    return b.token_select is not None and float(b.info.get("token_selection/tokens", -1)) == float(mask.sum())


def selection_mask(b, obj):
    """[B, T] the loss tokens a selection chooses among: the objective's loss origins in the rows that train."""
    mask = (b.mask(obj.loss_tokens) & b.attention_mask.bool() & b.known_mask).cpu()
    if b.row_mask is not None:
        mask &= b.row_mask.cpu()[:, None]
    return mask


def step_selection(b, e, plan, gate_of):
    """The step's token selection [B, T] for the loss reference: the run's choice on a batch that carries one (a whole
    step, or a mini-batch of it: check_token_selection recomputes the choice over the step's whole batch, or over the
    mini-batches of its first pass together, and fails where it cannot), else None (not covered)."""
    obj = e["objective"]
    if selection_of(obj) is None or b.token_select is None:
        return None
    return b.token_select.cpu()


def covariance_inputs(b, mask, adv: list):
    """(lp [N], A [N], the [B, T] mask) of the loss tokens (row-major): lp the behaviour log-prob the step starts with,
    A the referee's advantage of the token's row (Cov_t = (lp_t - mean lp)(A_t - mean A): `covariance_of`)."""
    m = mask.cpu().bool()
    cells = m.nonzero().tolist()  # row-major
    return [float(b.behavior_logprobs[i, t]) for i, t in cells], [float(adv[i]) for i, _t in cells], m


def covariance_of(lp: list, a: list) -> list:
    if not lp:
        return []
    mlp, ma = sum(lp) / len(lp), sum(a) / len(a)
    return [(x - mlp) * (y - ma) for x, y in zip(lp, a)]


def referee_entropy(rep, rec, e, b, mask):
    """H_t over the step's loss tokens (row-major) by a fresh forward of the weights recorded at the step's start
    (never the batch's `old_entropy`), and each token's row -> (entropies [N], rows [N]), or None when the run kept no
    weights for the step (then the check fails: not recomputed). The run's own H_t must equal them (ENTROPY_TOL)."""
    from composer.referee.record import fresh_entropy

    step = e["step"]
    if rec is None or step not in getattr(rec, "weights_at", {}):
        rep.expect("old-policy entropy recomputed", False, f"step {step} {e['term']}: no weights recorded at the step's "
                   "start: the entropies of the token selection cannot be recomputed")
        return None
    temp = e.get("temperature") or b.info.get("temperature", 1.0)
    fresh = fresh_entropy(rec.weights(step), b.tokens.cpu(), b.attention_mask.cpu(), temp)  # [B, T]
    m = mask.cpu().bool()
    if b.old_entropy is not None:
        err = float((fresh - b.old_entropy.detach().cpu().double()).abs()[m].max()) if m.any() else 0.0
        rep.expect("old-policy entropy recomputed", err <= ENTROPY_TOL,
                   f"step {step} {e['term']}: the run's entropies H_t are not those of the policy at the step's start "
                   f"(a fresh forward of its weights): off by {err:.3g}")
    cells = m.nonzero().tolist()  # row-major
    return [float(fresh[i, t]) for i, t in cells], [i for i, _t in cells]


def check_whole_groups(rep, events, term_events) -> None:
    """A term whose loss couples the rows of a group (`Objective.couples_rows`: a DPO pair) saw whole groups in every
    loss call: each group of the step's rollout with a row in the batch has all its rows there (the step's
    mini-batches and ranks split whole groups, composer/step.py), or its pairs and their normaliser would change.
    Rows are found again in the rollout by their tokens (`row_key`), which name their prompt and so their group."""
    from collections import Counter

    rolls: dict[int, list] = {}
    for k, e in events:
        if k == "rollout":
            rolls.setdefault(e["step"], []).append(e["batch"])
    for e in term_events:
        if type(e["objective"]).couples_rows is None:
            continue
        b, found = e["batch"], None
        for r in rolls.get(e["step"], []):
            where = {row_key(r, i): int(r.group[i]) for i in range(r.size)}
            if all(row_key(b, i) in where for i in range(b.size)):
                found = (r, where)
        if found is None:
            rep.note("pair terms see whole groups", "a loss batch whose rows are not all in a recorded rollout: "
                     "not checked")
            continue
        r, where = found
        size = Counter(int(g) for g in r.group.tolist())
        seen = Counter(where[row_key(b, i)] for i in range(b.size))
        cut = {g: (n, size[g]) for g, n in seen.items() if n != size[g]}
        rep.expect("pair terms see whole groups", not cut,
                   f"step {e['step']} {e['term']}: its loss saw part of a group (group: rows seen, rows in the "
                   f"rollout): {dict(list(cut.items())[:4])}; a term over pairs of rows needs every group whole")


def check_token_selection(rep, term_events, rec=None) -> None:
    """A step-wide token selection (grpo.token_selection): over every step, the run's choice against the selection's
    own reference (`reference_problem` in its file) at the statistic the referee recomputed: Cov_t from the behaviour
    log-probs and its own advantages (KL-Cov, Clip-Cov), or H_t from a fresh forward of the weights `rec` recorded at
    the step's start (entropy, archer). A step trained in mini-batches is checked over the mini-batches of its first
    pass together (whole groups, every row once); one whose mini-batches do not add up to the step's tokens fails.
    Fails when no token was ever selected (a check that cannot fail is none)."""
    seen = {"whole": 0, "parts": 0, "selected": 0}
    units, parts = [], {}  # units: lists of events that hold one whole step; parts: (step, term) -> mini-batches
    for e in term_events:
        b, obj = e["batch"], e["objective"]
        sel = selection_of(obj)
        if sel is None or b.advantages is None:
            continue
        if b.token_select is None:
            rep.expect(f"token selection ({sel.kind_name()}) recomputed", False,
                       f"step {e['step']} {e['term']}: the batch carries no token selection")
            continue
        mask = selection_mask(b, obj)
        if whole_step(b, mask):
            units.append([e])
            continue
        seen["parts"] += 1
        group = parts.setdefault((e["step"], e["term"]), [])
        held = sum(int(selection_mask(x["batch"], obj).sum()) for x in group)
        if held < float(b.info.get("token_selection/tokens", -1)):  # the first pass; later passes repeat its rows
            group.append(e)
    for (step, term), group in parts.items():
        obj = group[0]["objective"]
        held = sum(int(selection_mask(x["batch"], obj).sum()) for x in group)
        want = float(group[0]["batch"].info.get("token_selection/tokens", -1))
        if rep.expect(f"token selection ({selection_of(obj).kind_name()}) recomputed", held == want,
                      f"step {step} {term}: its mini-batches hold {held} loss tokens, the step's selection counted "
                      f"{want:g}: the step's choice cannot be recomputed"):
            units.append(group)
    for unit in units:
        obj = unit[0]["objective"]
        sel = selection_of(obj)
        name = f"token selection ({sel.kind_name()}) recomputed"
        stat, rows, got, lps, advs, base = [], [], [], [], [], 0
        for e in unit:
            b = e["batch"]
            mask = selection_mask(b, obj)
            m = mask.cpu().bool()
            if sel.by_entropy:  # the old policy's H_t, by the referee's own forward
                got_h = referee_entropy(rep, rec, e, b, mask)
                if got_h is None:
                    break
                stat += got_h[0]
                rows += [base + i for i in got_h[1]]
            else:
                adv = obj.reference_advantages(b.rewards.double().tolist(), b.group.tolist(), b.control.tolist(),
                                               b.mask(("policy",)).sum(-1).tolist())
                lp, a, m = covariance_inputs(b, mask, adv)
                lps += lp
                advs += a
            got += (b.token_select.cpu() & mask)[m].tolist()
            base += b.size
        else:
            if not sel.by_entropy:
                stat = covariance_of(lps, advs)  # over the step's tokens: every mini-batch of it together
            seen["whole"] += 1
            seen["selected"] += sum(got)
            why = sel.reference_problem(stat, got, rows if sel.by_entropy else None)
            rep.expect(name, why is None, f"step {unit[0]['step']} {unit[0]['term']}: {why}")
    if seen["whole"] or seen["parts"]:
        rep.expect("token selection selected tokens", seen["selected"] > 0,
                   f"no token selected in {seen['whole']} whole-step batches: nothing tested the selection")
        rep.note("token selection selected tokens", f"{seen['selected']} selected over {seen['whole']} whole-step batches "
                 f"({seen['parts']} mini-batch events, each step's first pass checked together)")


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
