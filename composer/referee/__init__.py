"""The conformance referee (DESIGN.md section 10): `composer check SPEC` runs a short recorded run of SPEC and
recomputes what trained from the spec and the recorded inputs alone (composer/referee/record.py keeps them,
composer/referee/checks.py holds the formulas). `referee(path)` -> a Report (a table of named checks)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from composer.referee.checks import (KL_TOL, NOISE, Report, _groups, _max, has_reference_loss, step_selection,
                                     declared_filter_source, declared_gate_source, expected_rewards, source_rewards,
                                     expected_syncs,
                                     loss_origins, segment_of, stage_start, surprisal, teacher_logprobs,
                                     teacher_state, truncated, verdict_rewards)
from composer.origins import CODE
from composer.stops import of
from composer.referee.record import GUIDE_ORIGINS, TOL, fresh_logprobs, row_key, run_recorded, segment_spec, short

__all__ = ["referee", "check_recorded", "run_recorded", "short", "Report"]


def referee(path, out_dir, extra=(), as_declared: bool = False) -> Report:
    """Run `path` short and recorded (overrides `extra` last) in `out_dir`, and check it."""
    v, plan, rec, rows = run_recorded(Path(path), Path(out_dir), extra, as_declared)
    rep = check_recorded(v, plan, rec, rows)
    rep.spec = str(path)
    from composer.referee.coverage import rows as coverage_rows

    # a part the run never made act checked nothing: "not exercised" is a failure, never a pass (issue 52 item 3)
    idle = [f"{r['path']} ({r['kind']}): {r['exercised'].partition(': ')[2]}" for r in coverage_rows(v, rep)
            if r["idle"]]
    if rep.expect("parts exercised", not idle, "not exercised: " + "; ".join(idle)):
        rep.note("parts exercised", "every declared part that acts changed what trained")
    rep.v = v
    return rep


def check_recorded(v, plan: dict, rec, rows: dict) -> Report:
    from composer.checks.terms import scored_origins, terms
    from composer.lang.curves import reference_value

    rep = Report()
    events = rec.events
    rolls = bool(rec.rollout_at)
    term_events = [e for k, e in events if k == "term_loss"]

    # ---- sampler: behaviour log-probs are a fresh forward of the rollout weights at the declared temperature
    if rolls:
        n = sum(1 for k, _e in events if k == "rollout")
        rep.expect("sampler log-probs (declared temperature)", not rec.logprob_errors,
                   f"behaviour log-probs differ from the rollout weights (step, max err, n bad, n): {rec.logprob_errors[:3]}")
        bf16 = rec.bf16_errors
        rep.note("sampler log-probs (declared temperature)", f"{n} rollouts" + (
            f"; a bf16 sampler: against the same bf16 weights run by transformers, to bf16 noise only (mean |d| at "
            f"most {max(m for _s, m, _x, _n in bf16):.2g}, max {max(x for _s, _m, x, _n in bf16):.2g} nats)"
            if bf16 else ""))

    # ---- each loss reads the policy at the temperature its spec declares (a fresh forward of the live weights)
    for e in term_events:
        if e["fresh"] is None:
            continue
        b = e["batch"]
        m = (b.mask(loss_origins(plan, e["step"], e["term"])) & b.attention_mask.bool()).cpu()
        g = e["grad"]
        if g is not None and bool((g != 0).any()):  # rows the loss depends on (autograd): a gate's unread rows are
            m &= (g != 0).any(-1, keepdim=True)      # never computed; a loss on logits only (full divergence) keeps all
        err = _max(e["view"].logprobs.detach().cpu().double() - e["fresh"].double(), m)
        rep.expect("loss log-probs (declared temperature)", err <= TOL,
                   f"step {e['step']} {e['term']}: the loss's log-probs are not the policy's at the declared "
                   f"temperature {e['temperature']:g} (off by {err:.3g})")

    # ---- guide tokens carry a behaviour log-prob exactly when an objective of their segment reads it; control rows
    control_of: dict[int, list] = {}
    prefixed = prefix_guides = 0  # rows that showed a prefix; rollouts under a prefix guide
    for kind, e in events:
        if kind != "rollout":
            continue
        b, spec = e["batch"], segment_spec(v, e["segment"])
        policy = b.mask(("policy",))
        rep.expect("policy tokens carry their log-prob", bool(b.known_mask[policy].all()),
                   f"step {e['step']}: a policy token without its sampling log-prob")
        for o in GUIDE_ORIGINS:
            m = b.mask((o,))
            if m.any():
                want = o in scored_origins(spec)
                rep.expect("guide tokens scored as declared", bool((b.known_mask[m] == want).all()),
                           f"step {e['step']}: {o}: known must be {want}")
        prefixed += _check_prefix_rows(rep, spec, b, e, rec.tokenizer, rec.written, rec.judged)
        prefix_guides += hasattr(spec.rollout.guide, "reference_prefix_steps")
        want = spec.rollout.guide.reference_control(spec, b, rec.tokenizer)  # the guide's own rule (its file)
        if want is None:
            rep.expect("control rows covered", False, f"step {e['step']}: guide {spec.rollout.guide.kind_name()} "
                       "declares no reference_control: its control rows are not covered")
            want = b.control.tolist()
        control_of[id(b.tokens)] = want
        guided = b.mask(GUIDE_ORIGINS).any(-1).tolist()
        bad_guided = [i for i in range(b.size) if want[i] and guided[i]]
        rep.expect("control rows carry no guide token", not bad_guided,
                   f"step {e['step']}: {len(bad_guided)} of {sum(want)} control rows (by the spec) carry guide tokens")
        flags = b.control.tolist()
        rep.expect("control rows as declared", flags == want,
                   f"step {e['step']}: control flags {sum(flags)} rows, the spec's {sum(want)} "
                   f"(differ at rows {[i for i in range(b.size) if flags[i] != want[i]][:6]})")
        if not spec.rollout.guide.writes_now():
            rep.expect("no guide, no guide tokens", not any(guided), f"step {e['step']}: guide tokens with no guide")

    if prefix_guides:
        rep.expect("saw prefixed rows", prefixed, f"no row showed a prefix in {prefix_guides} rollouts under a prefix "
                   "guide: the prefix rows' check saw nothing to check")

    # ---- gradient reaches exactly the origins plan.json trains
    for e in term_events:
        if e["grad_origins"] is None:
            continue
        trained = set(loss_origins(plan, e["step"], e["term"]))
        rep.expect("gradient only on trained origins", e["grad_origins"] <= trained,
                   f"{e['term']} at step {e['step']}: gradient on {e['grad_origins'] - trained}")

    # ---- episodes (rollout.environment): environment tokens never trained, its answers and the final answer's reward
    from composer.referee.episodes import check_episodes

    check_episodes(rep, v, plan, rec, events, term_events)

    # ---- every declared context with a text for a row is in the prompt the model saw
    prompts = [e for k, e in events if k == "prompt"]
    for e in prompts:
        for name, text in e["context"].items():
            if text is not None:
                rep.expect("declared contexts in prompts", text in e["text"],
                           f"{e['source']} ({e['usage']}): context '{name}' missing from its prompt")
    for seg in v.segments:
        for n, s in seg.spec.sources.items():
            if getattr(s, "context", None) and any(e["source"] == n for e in prompts):
                rep.expect("declared contexts in prompts", any(t is not None for e in prompts if e["source"] == n
                                                               for t in e["context"].values()),
                           f"{n}: no prompt carried its context")

    # ---- the objective in force is the plan's for the step's segment
    for e in term_events:
        seg = segment_of(plan, e["step"])
        want = next(t["objective"] for t in seg["terms"] if t["name"] == e["term"])
        got = {"kind": e["objective"].kind_name(),
               **e["objective"].model_dump(mode="json", by_alias=True, exclude={"kind"})}
        rep.expect("objective in force", got == want, f"step {e['step']}: objective {got} in force, the plan says {want}")

    # ---- segments start, and weights sync, at the declared steps; the sampler is the last synced policy
    starts = [(e["name"], e["step"]) for k, e in events if k == "segment"]
    rep.expect("segments start as planned", starts == [(s["name"], s["start"]) for s in plan["segments"]],
               f"segments started {starts}")
    declared = expected_syncs(plan)
    syncs = [e["after"] for k, e in events if k == "sync"]
    rep.expect("syncs as planned", syncs == declared, f"syncs after {syncs}, the plan's {declared}")
    bf16 = v.segments[0].spec.rollout.precision == "bf16"  # fixed for the run (validation)
    for s, fp in rec.rollout_at.items():
        last = max([d for d in declared if d <= s] + [0])
        if last in rec.policy_at:
            want = (rec.policy_bf16_at if bf16 else rec.policy_at)[last]
            rep.expect("sampler = policy after the last sync" + (" (rounded to bf16)" if bf16 else ""), fp == want,
                       f"step {s}: rollouts sampled by weights other than those after step {last}"
                       + (" rounded to bfloat16 (rollout.precision: bf16)" if bf16 else ""))
    rep.expect("policy tokens sampled by the policy", not rec.not_sampled,
               "tokens labelled policy that the rollout weights never sampled after the text before them "
               f"(step, row, position): {rec.not_sampled[:5]}")

    # ---- the verifier parsed something in every segment that verified
    by_seg: dict = {}
    for step, seg, _verifier, parsed in rec.verdict_log:
        by_seg.setdefault(seg, []).append(parsed)
    for seg, ps in by_seg.items():
        rep.expect("verifier parsed answers", any(ps), f"segment {seg}: the verifier parsed 0 of {len(ps)} answers")
        rep.note("verifier parsed answers", ", ".join(f"{s}: {sum(p)}/{len(p)}" for s, p in by_seg.items()))

    _check_verdicts(rep, rec)

    # ---- gates, recomputed from the verifier's rewards and the spec's thresholds
    gated_rows: dict = {}
    gate_of: dict[int, list] = {}  # id(term event) -> the referee's rows (None: no gate)
    eos = of(rec.tokenizer).ids if rec.tokenizer is not None else None  # the stop tokens (composer/stops.py)
    filtered = _filter_reference(v, rec, events, term_events, eos)  # per step: the rows its rollout.filter keeps
    for e in term_events:
        spec = segment_spec(v, e["segment"])
        names = [n for n, _s, _o, _w in terms(spec)]
        gate = next((g for n, g in zip(names, _gates(spec)) if n == e["term"]), None)
        b = e["batch"]
        want = None
        rows_, slot, where, kept = _step_rows(events, e["step"], b, spec.rollout.samples_per_prompt, filtered) \
            if gate is not None or e["step"] in filtered else (None, None, None, None)
        if gate is not None:
            # over the step's rollout as its terms see it: after rollout.filter, only the rows (and groups) it kept
            src = declared_gate_source(gate, spec)
            thr = spec.sources[src].success_threshold
            if rows_ is None:
                rep.expect("gate rows recomputed", False, f"step {e['step']} {e['term']}: no recorded rollout for its gate")
                continue
            r = _per_row(rows_, lambda x: verdict_rewards(rec, spec, src, x))
            if r is None:
                rep.expect("gate rows recomputed", False, f"step {e['step']} {e['term']}: rows without a verdict")
                continue
            ok = [x >= thr for x in r]
            sel = gate.reference_rows(ok, slot, _per_row(rows_, surprisal) if gate.reads_surprisal else None)
            if where is not None:
                want = [sel[j] for j in where]
            else:  # a batch its signal built: each row takes its prompt's rollouts' group facts
                by_prompt = {rows_[j][0].examples[rows_[j][1]].prompt: sel_group for j, sel_group in enumerate(
                    gate.model_copy(update={"outcome": None, "sibling_success": None}).reference_rows(ok, slot, None))}
                want = [by_prompt.get(ex.prompt, False) for ex in b.examples]
            gated_rows.setdefault(e["term"], [0, 0])
            gated_rows[e["term"]][0] += sum(want)
            gated_rows[e["term"]][1] += len(want)
        if where is not None and kept is not None and not all(kept):  # rollout.filter.truncated masks these rows
            want = [(True if want is None else want[i]) and kept[where[i]] for i in range(b.size)]
        gate_of[id(e)] = want
        got = None if b.row_mask is None else b.row_mask.cpu().tolist()
        if want is not None or got is not None:
            w2 = want if want is not None else [True] * b.size
            g2 = got if got is not None else [True] * b.size
            rep.expect("gate rows recomputed", w2 == g2,
                       f"step {e['step']} {e['term']}: the run trained rows {[i for i, x in enumerate(g2) if x][:8]}, "
                       f"the gate selects {[i for i, x in enumerate(w2) if x][:8]} ({sum(g2)} vs {sum(w2)} of {b.size})")
    for term, (sel, n) in gated_rows.items():
        rep.expect("every gated term selected a row", sel > 0, f"term {term}: its gate selected 0 of {n} rows")
    if gated_rows:
        rep.note("every gated term selected a row", ", ".join(f"{t}: {s}/{n}" for t, (s, n) in gated_rows.items()))

    # ---- filters: which prompts and rows the step's rollout.filter keeps, how many rounds it takes
    _check_filters(rep, filtered, term_events)

    # ---- the numbers: advantages, references, teachers, each loss and gradient
    seen = {"advantages": 0, "mixed_groups": 0, "mixed_rewards": 0, "reference": 0, "stage_reference": 0, "gradient": 0, "kl": 0,
            "teacher": 0, "ema_moved": 0, "interventions": 0, "reward_parts": 0, "old": 0}
    cache: dict = {}
    task_cap = next((e.get("task_cap") for k, e in events if k == "rollout"), None)
    for e in term_events:
        b, obj, step = e["batch"], e["objective"], e["step"]
        spec = segment_spec(v, e["segment"])
        sig = next(s for n, s, _o, _w in terms(spec) if n == e["term"])
        temp = e["temperature"] if e["temperature"] is not None else spec.rollout.temperature
        resp = b.response_mask.cpu()
        seen["interventions"] += int((b.origin == CODE_INT).sum())
        rollout, where = _rollout_rows(events, step, b)
        control = b.control.tolist()
        if where is not None and id(rollout.tokens) in control_of:
            control = [control_of[id(rollout.tokens)][j] for j in where]
        if b.rewards is not None and sig is not None and sig.usage == "reward":  # before the advantages read them
            got_parts = expected_rewards(rec, spec, sig, b, task_cap, step)
            if got_parts is None:
                rep.note("rewards recomputed", "a row without its verdict, or a plugin's reward part: not recomputed")
            else:
                want_r, acted = got_parts
                seen["reward_parts"] += acted
                got_r = b.rewards.double().tolist()
                bad = [(i, got_r[i], want_r[i]) for i in range(b.size) if abs(got_r[i] - want_r[i]) > 1e-5 * (1 + abs(want_r[i]))]
                rep.expect("rewards recomputed", not bad, f"step {step} {e['term']}: rewards (row, run, the source's "
                           f"(a verifier's verdicts, a reward model's scores) and the declared parts) differ: {bad[:4]}")
        targets = getattr(sig, "reference_targets", None)  # a signal training on the rollout's own rows (its file)
        if callable(targets) and rollout is not None:
            want_t = targets(rollout, where or [])  # None: the signal's targets are not the rollout's rows
            if want_t is not None:
                got_t = [(b.tokens[i][b.attention_mask[i].bool()].tolist(), b.origin[i][b.attention_mask[i].bool()]
                          .tolist()) for i in range(b.size)]
                rep.expect("targets are the rollout's rows", where is not None and got_t == want_t,
                           f"step {step} {e['term']}: the term's rows are not the step's rollout rows as sampled")
        adv = None
        if b.advantages is not None and b.advantages.dim() == 1:  # per-token advantages (a critic): check_critics
            r, g = b.rewards.double().tolist(), b.group.tolist()
            adv = obj.reference_advantages(r, g, control, b.mask(("policy",)).sum(-1).tolist())
            if not rep.expect("advantages recomputed", adv is not None,
                              f"{obj.kind_name()} has advantages but no reference (`reference_advantages` in its own "
                              "file, or its estimator's `reference`): not covered"):
                continue
            got = b.advantages.double().tolist()
            bad = [(i, got[i], adv[i]) for i in range(len(adv)) if abs(got[i] - adv[i]) > 1e-4 * (1 + abs(adv[i]))]
            rep.expect("advantages recomputed", not bad, f"step {step} {e['term']}: advantages (row, run, formula) differ: {bad[:4]}")
            for rows_ in _groups(g).values():
                rep.expect("groups hold one prompt", len({b.examples[i].prompt for i in rows_}) == 1,
                           f"step {step}: a group mixes prompts")
                seen["mixed_groups"] += len({r[i] for i in rows_}) > 1
            seen["mixed_rewards"] += len(set(r)) > 1  # rows of both outcomes in one batch
            seen["advantages"] += 1

        ref = None
        start = stage_start(plan, spec, step)
        if b.initial_logprobs is not None and start in rec.weights_at:
            ref = fresh_logprobs(rec.weights(start), b.tokens.cpu(), b.attention_mask.cpu(), temp)
            err = _max(ref - b.initial_logprobs.cpu(), resp)
            tol, sep = TOL, None
            if start > 0 and 0 in rec.weights_at:  # a later stage: its reference must not be an earlier stage's
                stale = fresh_logprobs(rec.weights(0), b.tokens.cpu(), b.attention_mask.cpu(), temp)
                sep = _max(stale - ref, resp)
                tol = max(min(TOL, sep / 2), NOISE)
                seen["stage_reference"] += sep > 4 * NOISE
            rep.expect("reference = weights at the stage's start", err <= tol,
                       f"step {step} {e['term']}: reference log-probs are not those of the weights at the stage's "
                       f"start (step {start}): off by {err:.3g}" + (f" (the run's start is {sep:.3g} away)" if sep else ""))
            seen["reference"] += 1

        if b.teacher_logprobs is not None and sig.usage == "teacher":
            _check_teacher(v, plan, rec, rep, e, spec, sig, seen, cache)

        old = b.behavior_logprobs.detach().cpu() if b.behavior_logprobs is not None else None
        if b.old_logprobs is not None and step in rec.weights_at:
            # the ratio's denominator: a fresh forward of the weights at the step's start (before its first update),
            # never the batch's own field (DESIGN.md section 10)
            fresh = fresh_logprobs(rec.weights(step), b.tokens.cpu(), b.attention_mask.cpu(), temp)
            err = _max(fresh - b.old_logprobs.detach().cpu(), resp)
            rep.expect("old log-probs = the weights at the step's start", err <= TOL,
                       f"step {step} {e['term']}: the ratio's old log-probs are not those of the policy at the step's "
                       f"start (before its first update): off by {err:.3g}")
            seen["old"] += 1
            # the formulas below read the run's old log-probs once they are shown to be the fresh forward's (to float32
            # noise): a KL coefficient of 1e-4 would magnify that noise in the per-unit KL gradient 1e4 times
            old = b.old_logprobs.detach().cpu() if err <= TOL else fresh
        elif b.old_logprobs is not None:
            old = b.old_logprobs.detach().cpu()
        if e["grad"] is not None and obj.value_model() is None:  # the part's own reference loss (its file)
            # (an objective with a critic: its policy loss with the referee's GAE in composer/referee/critic.py)
            kl = float(reference_value(getattr(obj, "kl_coef", 0.0), step)) if obj.wants_initial else 0.0
            if ref is None and (kl or obj.wants_initial) and start in rec.weights_at:
                ref = fresh_logprobs(rec.weights(start), b.tokens.cpu(), b.attention_mask.cpu(), temp)
            _check_reference_loss(rep, e, plan, gate_of, seen,
                                  {"old": old, "initial": ref, "advantages": adv, "kl_coef": kl,
                                   "token_select": step_selection(b, e, plan, gate_of)})

    objectives = [(seg, obj) for seg in v.segments for _n, _s, obj, _w in terms(seg.spec) if obj is not None]
    if any(obj.group_baseline() for _s, obj in objectives) and rolls:
        rep.expect("saw mixed groups", seen["advantages"] and seen["mixed_groups"],
                   f"no mixed group seen: nothing tested the advantages ({seen['advantages']} batches)")
    elif any(type(obj).uses_group_baseline for _s, obj in objectives) and rolls:  # its estimator takes no baseline
        rep.expect("saw mixed rewards", seen["advantages"] and seen["mixed_rewards"],
                   f"no batch held rows of different rewards: the advantages of one outcome went untested "
                   f"({seen['advantages']} batches)")
    if any(obj.wants_initial for _s, obj in objectives) and rolls:
        rep.expect("saw reference log-probs", seen["reference"], "no reference log-prob checked")
    if any(has_reference_loss(obj) for _s, obj in objectives) and rolls:
        rep.expect("saw gradients", seen["gradient"], "no gradient checked against its formula")
    if any(sig is not None and sig.usage == "teacher" for seg in v.segments for _n, sig, _o, _w in terms(seg.spec)):
        rep.expect("saw teacher log-probs", seen["teacher"], "no teacher log-prob checked")
    if any(getattr(s, "is_self", False) and getattr(s, "weights", None) == "ema" for seg in v.segments
           for s in seg.spec.sources.values()) and seen["teacher"]:
        rep.expect("EMA teacher moved", seen["ema_moved"],
                   f"the EMA teacher never differed from its start in {seen['teacher']} checks: a frozen teacher "
                   "would pass (run longer)")
    if any(sig is not None and sig.usage == "reward" and sig.plus for seg in v.segments
           for _n, sig, _o, _w in terms(seg.spec)) and rolls:
        rep.expect("saw reward parts act", seen["reward_parts"],
                   "no row's reward was changed by the declared `plus` parts: their formula went untested")
    if any("guide_intervention" in obj.loss_tokens and has_reference_loss(obj) for _s, obj in objectives):
        rep.expect("saw trained interventions", seen["interventions"], "no intervention token trained")
    rep.note("saw gradients", ", ".join(f"{k} {n}" for k, n in seen.items()))

    # ---- a learned critic (PPO): its values, GAE, its updates, the policy loss; a reward model's scores
    from composer.referee.critic import check_critics

    check_critics(v, plan, rec, rep, events, term_events)

    # ---- every stage moved the weights, and the sampler check could tell syncs apart
    _check_stages(plan, rec, rep, v)
    _check_frozen(v, rec, rep, events)
    if len(rec.rollout_at) >= 2:
        rep.expect("weights moved", len(set(rec.policy_at.values())) >= 2,
                   "the policy's weights never moved: the sync checks saw nothing")

    # ---- offpolicy_token_frac recounts from the batch that trained
    for e in term_events:
        if e["term"] == "term0" and "offpolicy_token_frac" in rows.get(e["step"], {}):
            b = e["batch"]
            resp = b.response_mask
            off = b.mask(("guide_prefix", "guide_intervention", "demonstration")) & resp
            logged = rows[e["step"]]["offpolicy_token_frac"]
            if logged and b.rewards is not None:
                want = float(off.sum() / resp.sum().clamp(min=1))
                rep.expect("offpolicy_token_frac recounted", abs(float(logged) - want) <= 1e-6,
                           f"step {e['step']}: logged {logged}, recounted {want}")

    # ---- step-wide token selection (grpo.token_selection: KL-Cov, Clip-Cov, 80/20 entropy, Archer), recomputed
    from composer.referee.checks import check_token_selection, check_traces, check_whole_groups

    check_token_selection(rep, term_events, rec)
    check_whole_groups(rep, events, term_events)  # a term over pairs of rows (couples_rows) saw whole groups
    # ---- traces the policy did not write inside groups (the traces guide): which rows, their tokens, the groups
    check_traces(rep, rec, v, events)

    # ---- every optimiser update: the parameter gradient, the clip, AdamW at the declared LR, fresh moments
    from composer.referee.optim import check_updates

    check_updates(rep, rec.updates)
    return rep


CODE_INT = CODE["guide_intervention"]


def _gates(spec) -> list:
    from composer.checks.terms import gates

    return gates(spec)


def _rollout_rows(events, step: int, b):
    """(the recorded rollout of `step` b's rows come from, the index of each of b's rows in it); (None, None)."""
    rolls = [e["batch"] for k, e in events if k == "rollout" and e["step"] == step]
    for r in rolls:
        if r.tokens is b.tokens:
            return r, list(range(b.size))
    for r in reversed(rolls):  # a mini-batch or a filter's concatenation: the same rows
        idx = {}
        for i in range(r.size):
            idx.setdefault(row_key(r, i), i)
        got = [idx.get(row_key(b, i)) for i in range(b.size)]
        if all(g is not None for g in got):
            return r, got
    return (rolls[-1], None) if rolls else (None, None)


def _check_reference_loss(rep, e, plan, gate_of, seen, inputs: dict) -> None:
    """The term's loss value and its gradient d loss / d log pi [B, T] against the objective's `reference_loss` (its
    own file: DESIGN.md section 10), on the loss tokens the plan trains and the rows its gate took. An objective
    without one is noted "not covered" (the chain rule from the run's own gradient proves nothing of its formula)."""
    import torch

    b, obj, step = e["batch"], e["objective"], e["step"]
    mask = (b.mask(loss_origins(plan, step, e["term"])) & b.attention_mask.bool()).cpu()
    rows_ = gate_of.get(id(e))
    if rows_ is not None:
        mask = mask & torch.tensor(rows_, dtype=torch.bool)[:, None]
    want = obj.reference_loss(b, mask, e["view"], inputs)
    if want is None and not has_reference_loss(obj):  # a part nothing checks is never a pass
        rep.expect("loss covered", False, f"step {step} {e['term']}: objective {obj.kind_name()} declares no "
                   "reference_loss in its file: its loss is not covered (docs/plugins.md: the reference)")
        return
    if want is None:
        rep.note("loss recomputed (reference)", f"{obj.kind_name()}: a mini-batch of its step, whose token selection "
                 "is the whole step's: not covered")
        return
    grad = e["grad"].double()
    scale = want.get("scale") or (float(want["grad"].abs()[mask].max()) if mask.any() else 0.0)
    unit = 1.0 / scale if scale > 0 else 1.0  # errors per unit of the gradient's own scale
    err = float((want["grad"] - grad).abs().max()) * unit
    rep.expect("loss gradient recomputed (reference)", err <= 5e-3,
               f"step {step} {e['term']}: the loss's gradient differs from {obj.kind_name()}'s reference_loss on the "
               f"declared tokens and rows (by {err:.3g} per unit)")
    rep.expect("loss value recomputed (reference)", abs(e["loss_value"] - want["value"]) <= 1e-4 * (1 + abs(want["value"])),
               f"step {step} {e['term']}: loss {e['loss_value']:.6g}, {obj.kind_name()}'s reference_loss "
               f"{want['value']:.6g}")
    seen["gradient"] += 1
    rep.checked[e["term"]] = rep.checked.get(e["term"], 0) + 1
    for part, n in (want.get("acted") or {}).items():  # where the part changed the loss (coverage: exercised)
        rep.act(e["term"], part, n)
    lengths = {int(n) for n in mask.sum(-1).tolist() if n}  # an aggregation tells rows apart only by their lengths
    rep.act(e["term"], "aggregation", len(lengths) > 1)
    kl_coef = float(inputs.get("kl_coef") or 0.0)
    if kl_coef > 0 and "kl_grad" in want:  # the KL term on its own, per unit of kl_coef: a small one hides nothing
        est = getattr(obj, "kl_estimator", "kl")
        pg_grad = want["grad"] - kl_coef * want["kl_grad"]
        kerr = float(((grad - pg_grad) / kl_coef - want["kl_grad"]).abs().max()) * unit
        rep.expect(f"KL term ({est}) gradient at kl_coef", kerr <= KL_TOL,
                   f"step {step} {e['term']}: the KL term's gradient per unit kl_coef is off by {kerr:.3g} from "
                   f"{obj.kind_name()}'s reference (kl_coef {kl_coef:g})")
        kval = (e["loss_value"] - (want["value"] - kl_coef * want["kl_value"])) / kl_coef
        rep.expect(f"KL term ({est}) value at kl_coef",
                   abs(kval - want["kl_value"]) <= KL_TOL * (1e-2 + abs(want["kl_value"])) + 1e-3,
                   f"step {step} {e['term']}: KL value {kval:.4g}, the reference's {want['kl_value']:.4g}")
        seen["kl"] += 1


def _check_prefix_rows(rep, spec, b, e, tokenizer, written, judged) -> int:
    """A prefix guide's rows: which prompts are guided and how many reference steps each row shows (its prompt's
    text, or its guide_prefix tokens), recomputed from the spec (the guide's `reference_prefix_steps`); the steps shown are the
    row's own reference's first ones."""
    from composer.referee.checks import shown_prefix_steps

    g = spec.rollout.guide
    if not hasattr(g, "reference_prefix_steps") or tokenizer is None:
        return 0
    src = spec.sources[g.reference]
    sep = e.get("step_split") or "\n"
    where = b.mask(("prompt",) if g.placement == "prompt" else ("guide_prefix",)) & b.attention_mask.bool()
    guided = 0
    for i in range(b.size):
        ex = b.examples[i] if len(b.examples) == b.size else b.examples[int(b.prompt_index[i])]
        text = tokenizer.decode(b.tokens[i][where[i]].tolist(), skip_special_tokens=True)
        if g.placement == "prompt":
            text = text.replace(ex.problem or "\0", "\0", 1)  # the problem's own text is not a step shown
        if src.model_path is None:  # a reference text, not a model's traces
            refs = [src.example_text(ex) or ""]
        else:  # a model's trace: the first the declared model wrote for this problem that the verifier accepted
            texts = ((tokenizer.decode(list(p), skip_special_tokens=True), tokenizer.decode(list(t), skip_special_tokens=True))
                     for m, p, t in written if m == g.reference)
            refs = [next((t for p, t in texts if (ex.problem or ex.prompt) in p and judged.get((ex.problem, t))), "")]
        best = None
        for ref in refs:
            if g.unit == "tokens":  # placement response: the guide_prefix tokens are the reference's first k
                units = tokenizer.encode(ref, add_special_tokens=False)
                shown = b.tokens[i][where[i]].tolist()
                k = len(shown) if shown == units[: len(shown)] else -1
            else:
                units = ref.split(sep)
                while units and not units[-1].strip():
                    units.pop()
                k = shown_prefix_steps(text, units, sep)
            want = g.reference_prefix_steps(spec, ex, e["step"], len(units))
            steps = units
            if best is None or (want[0] <= k <= want[1] and k >= best[0]):
                best = (k, want, len(steps))
        k, want, n = best
        guided += k > 0
        rep.expect("prefix rows recomputed", want[0] <= k <= want[1],
                   f"step {e['step']} row {i}: shows {k} {g.unit} of '{g.reference}' (-1: not its first ones); the spec allows "
                   f"{want[0]}..{want[1]} (guided_fraction {g.guided_fraction:g}, max_fraction {g.max_fraction:g} "
                   f"of {n}, search {g.search})")
    return guided


def _filter_reference(v, rec, events, term_events, eos) -> dict:
    """Per step whose segment declares an active rollout.filter: {"flt", "batches": its recorded sampling rounds,
    "ref": the filter's own `reference_rows` over them (composer/filters.py)}, the rewards it reads being its
    source's (the verifier's verdicts as returned, or a reward model's fresh score) and a row cut where its
    response ends in no stop token (`truncated`)."""
    out: dict = {}
    for step in sorted({e["step"] for e in term_events}):
        first = next(e for e in term_events if e["step"] == step)
        spec = segment_spec(v, first["segment"])
        flt = spec.rollout.filter
        rounds = [e["batch"] for k, e in events if k == "rollout" and e["step"] == step]
        if not flt.active or eos is None or not rounds:
            continue
        src = declared_filter_source(flt, spec)

        def rewards_of(k, rounds=rounds, spec=spec, src=src, step=step):
            return None if src is None else source_rewards(rec, spec, src, rounds[k], step)

        env = spec.rollout.environment
        decode = (lambda ids: rec.tokenizer.decode(ids, skip_special_tokens=True)) if env.active else None
        stop_strings = tuple(env.stop_strings()) if env.active else ()
        ref = flt.reference_rows(rewards_of, [truncated(r, eos, decode, stop_strings) for r in rounds],
                                 spec.rollout.samples_per_prompt, spec.train.prompts_per_step)
        out[step] = {"flt": flt, "batches": rounds, "ref": ref, "n": spec.rollout.samples_per_prompt,
                     "prompts": spec.train.prompts_per_step, "epochs": spec.train.epochs}
    return out


def _step_rows(events, step: int, b, n: int, filtered: dict):
    """The rows of `step`'s rollout as its terms see them -> (rows [(recorded batch, i)], the prompt slot of each,
    where: the index in rows of each of b's rows (None: b is a batch its signal built), kept: the filter's row mask
    over rows (None: every row)); all None when no rollout was recorded. Under an active rollout.filter they are
    the rows its `reference_rows` keeps (the kept prompts of every round, less the rows `truncated: drop` removes);
    otherwise the recorded rollout's (rows prompt by prompt, n each)."""
    f = filtered.get(step)
    if f is not None and f["ref"] is not None:
        rows = [(f["batches"][k], i) for k, i in f["ref"]["rows"]]
        slot, kept = list(f["ref"]["prompt"]), list(f["ref"]["trained"])
    else:
        rollout, _where = _rollout_rows(events, step, b)
        if rollout is None:
            return None, None, None, None
        rows, slot, kept = [(rollout, i) for i in range(rollout.size)], [i // n for i in range(rollout.size)], None
    keys = [row_key(r, i) for r, i in rows]
    mine = [row_key(b, i) for i in range(b.size)]
    if mine == keys:
        return rows, slot, list(range(b.size)), kept
    idx: dict = {}
    for j, k in enumerate(keys):
        idx.setdefault(k, j)
    where = [idx.get(k) for k in mine]
    return rows, slot, (where if all(w is not None for w in where) else None), kept


def _per_row(rows, fn):
    """`fn(batch)` (a list over that batch's rows, None when not recomputable) read at each of `rows`
    [(batch, i)]; None if any batch gave None."""
    cache: dict = {}
    out = []
    for r, i in rows:
        if id(r) not in cache:
            cache[id(r)] = fn(r)
        if cache[id(r)] is None:
            return None
        out.append(cache[id(r)][i])
    return out


def _check_verdicts(rep, rec) -> None:
    """Every verdict the run's scorer returned, recomputed: the row's response (every token after its prompt, as the
    recorded batch holds it; an episode's final answer) decoded by the referee and the declared verifier run on it again through the source's
    own `reference_verdicts` (its file), looked up by name in the registry; the reward and `parsed` must agree. A
    source that returns verdicts without that reference is "not covered"."""
    if not rec.verified or rec.tokenizer is None:
        return
    from composer.referee.episodes import final_answer

    done: dict = {}
    for step, cfg, task_verifier, tokens, origins, example, got in rec.verified:
        if not hasattr(cfg, "reference_verdicts"):
            rep.expect("verdicts re-verified", False, f"source {cfg.kind_name()} returns verdicts but declares no "
                       "reference_verdicts in its file: its rewards are not covered")
            continue
        # the response, or in an episode its final answer (composer/referee/episodes.py `final_answer`: the tokens
        # after the last environment turn the policy answered); the same tokens without an environment token
        text = rec.tokenizer.decode(final_answer(list(tokens), list(origins)), skip_special_tokens=True)
        key = (id(cfg), task_verifier, text, id(example))
        if key not in done:
            done[key] = cfg.reference_verdicts([text], [example], task_verifier)[0]
        want = done[key]
        rep.expect("verdicts re-verified", abs(got[0] - want[0]) <= 1e-9 and got[1] == want[1],
                   f"step {step}: the run's verdict (reward {got[0]:g}, parsed {got[1]}) is not the declared verifier's "
                   f"on the row's decoded response (reward {want[0]:g}, parsed {want[1]}): {text[-60:]!r}")
    rep.note("verdicts re-verified", f"{len(rec.verified)} responses, each decoded again and scored by the declared "
             "verifier")


def _check_filters(rep, filtered: dict, term_events) -> None:
    """rollout.filter, recomputed by its own `reference_rows` (`_filter_reference`) over each step's recorded
    sampling rounds: how many rounds the step takes, and which rows each term trains on over the step's
    mini-batches (each kept row once a pass, train.epochs passes; equal_groups: drop keeps the mixed prompts,
    topped up with dropped ones only when the rounds ran out; truncated: drop removes the cut rows, so a prompt's
    group may keep fewer than samples_per_prompt rows); each advantage group lies inside one kept prompt. A filter whose parts never acted in the run (no prompt with
    all-equal rewards, no response cut at max_new_tokens) is "not exercised"; one that kept no row fails."""
    kept_total = sampled_total = prompts_sampled = 0
    acted = {"equal_groups": 0, "truncated": 0}
    declared = {"equal_groups": False, "truncated": False}
    for step, f in sorted(filtered.items()):
        flt, ref, batches, n = f["flt"], f["ref"], f["batches"], f["n"]
        declared["equal_groups"] |= flt.equal_groups != "keep"
        declared["truncated"] |= flt.truncated != "keep"
        if not rep.expect("filter groups recomputed", ref is not None,
                          f"step {step}: rollout rows without the reward the filter reads"):
            continue
        sampled = sum(r.size for r in batches)
        sampled_total += sampled
        prompts_sampled += sum(r.size // n for r in batches)
        kept_total += sum(ref["trained"])
        acted["equal_groups"] += sum(r.size // n for r in batches[:ref["rounds"] or len(batches)]) - sum(ref["mixed"])
        acted["truncated"] += ref["cut"]
        rep.expect("filter rounds recomputed", ref["rounds"] == len(batches),
                   f"step {step}: {len(batches)} sampling round(s) with {ref['mixed']} mixed groups; the filter should "
                   f"have taken {ref['rounds'] or f'more than {len(batches)}'} (prompts_per_step {f['prompts']}, "
                   f"max_rounds {flt.max_rounds})")
        want = [row_key(batches[k], i) for k, i in ref["rows"]]
        slot_of: dict = {}
        for key, sl in zip(want, ref["prompt"]):
            slot_of.setdefault(key, sl)
        recorded = {row_key(r, i) for r in batches for i in range(r.size)}
        by_term: dict = {}  # term -> [(event, its rows' keys)]: its mini-batches, every pass (train.epochs)
        for e in term_events:
            if e["step"] != step:
                continue
            got = [row_key(e["batch"], i) for i in range(e["batch"].size)]
            if any(k in recorded for k in got):  # else a batch its signal built (SFT on references)
                by_term.setdefault(e["term"], []).append((e, got))
        for term, evs in by_term.items():
            got_all = Counter(k for _e, got in evs for k in got)
            want_all = Counter({k: c * f["epochs"] for k, c in Counter(want).items()})
            extra, missing = sum((got_all - want_all).values()), sum((want_all - got_all).values())
            rep.expect("filter rows recomputed", not extra and not missing,
                       f"step {step} {term}: the run trained {sum(got_all.values())} rows over {f['epochs']} pass(es), "
                       f"the filter keeps {len(want)} a pass ({sum(ref['mixed'])} mixed prompt(s) for {f['prompts']}, "
                       f"{ref['topped_up']} all-equal topping up, {ref['cut']} row(s) cut at max_new_tokens: truncated "
                       f"{flt.truncated}): {extra} row(s) it does not keep, {missing} kept row(s) not trained")
            for e, got in evs:
                b = e["batch"]
                split = [g for g, rows in _groups(b.group.tolist()).items()
                         if len({slot_of.get(got[i]) for i in rows}) > 1]
                rep.expect("filter groups recomputed", not split,
                           f"step {step} {term}: advantage group(s) {split[:4]} span several kept prompts (or rows "
                           "the filter does not keep)")
    if not filtered:
        return
    rep.expect("filter kept rows", kept_total > 0,
               f"the filter left no row to train on: 0 of {sampled_total} sampled rows ({prompts_sampled} prompts; "
               f"{acted['truncated']} cut at max_new_tokens, {acted['equal_groups']} prompt(s) with all-equal rewards)")
    rep.note("filter kept rows", f"{kept_total} rows trained of {sampled_total} sampled ({prompts_sampled} prompts); "
             f"{acted['equal_groups']} all-equal prompt(s), {acted['truncated']} row(s) cut at max_new_tokens")
    for part, on in declared.items():
        if on:
            what = {"equal_groups": "no prompt's rollouts all got the same reward: equal_groups: drop dropped nothing",
                    "truncated": "no response was cut at max_new_tokens: the truncated filter removed nothing "
                                 "(a lower rollout.max_new_tokens makes it act)"}[part]
            rep.expect(f"filter {part} exercised", acted[part] > 0,
                       f"not exercised: in {sampled_total} sampled rows, {what}")


def _check_teacher(v, plan, rec, rep, e, spec, sig, seen, cache) -> None:
    from composer.runtime.models import load_model, load_tokenizer, resolve

    b, step = e["batch"], e["step"]
    src = spec.sources[sig.teacher]
    if src.is_self and step not in rec.weights_at:
        return
    if src.context:
        texts = [p["text"] for k, p in rec.events if k == "prompt" and p["step"] == step
                 and p["source"] == sig.teacher and p["usage"] == "teacher"]
        rows = [i for i in range(b.size) if float(b.weights()[i]) > 0]
        if not rep.expect("teacher log-probs recomputed", len(texts) == len(rows),
                          f"step {step}: {len(texts)} teacher prompts for {len(rows)} rows"):
            return
        tok = rec.tokenizer if src.is_self or src.shares_tokenizer else load_tokenizer(resolve(src.model))
        ids = [None] * b.size
        for i, text in zip(rows, texts):
            ids[i] = tok.encode(text, add_special_tokens=False)
    else:
        rows, ids = list(range(b.size)), [None] * b.size
    m = b.response_mask.cpu().clone()
    m[[i for i in range(b.size) if i not in rows]] = False
    if not src.is_self:
        if sig.teacher not in cache:
            cache[sig.teacher] = load_model(resolve(src.model), spec.policy.dtype).eval()
        want = teacher_logprobs(cache[sig.teacher], b, ids, src.temperature)
        err, tol = _max(want - b.teacher_logprobs.cpu(), m), TOL
    else:
        rec.scratch.load_state_dict(teacher_state(rec, spec, plan, sig.teacher, step))
        want = teacher_logprobs(rec.scratch, b, ids, src.temperature)
        err, tol = _max(want - b.teacher_logprobs.cpu(), m), TOL
        if src.weights == "ema":  # told apart from a teacher frozen at its start
            rec.scratch.load_state_dict(rec.weights_at[stage_start(plan, spec, step)])
            frozen = teacher_logprobs(rec.scratch, b, ids, src.temperature)
            sep = _max(frozen - want, m)
            tol = max(min(TOL, sep / 2), NOISE)
            seen["ema_moved"] += sep > 4 * NOISE
    rep.expect("teacher log-probs recomputed", err <= tol,
               f"step {step}: teacher '{sig.teacher}' log-probs are not those of the weights it declares "
               f"({src.weights if src.is_self else src.model}): off by {err:.3g} (tolerance {tol:.3g})")
    seen["teacher"] += bool(m.any())


def _check_stages(plan, rec, rep, v=None) -> None:
    """Each stage moved the weights: its start's weights differ from the next stage's start (or the run's end); a
    stage whose every segment freezes the policy (train.freeze_policy) is checked by `_check_frozen` instead."""
    from composer.referee.record import fingerprint

    frozen = {s.stage for s in (v.segments if v is not None else []) if s.stage is not None} - {
        s.stage for s in (v.segments if v is not None else []) if not s.spec.train.freeze_policy}
    stages = []
    for s in plan["segments"]:
        if s.get("stage") is not None and (not stages or stages[-1][0] != s["stage"]):
            stages.append([s["stage"], s["start"], s["end"]])
        elif stages and s.get("stage") is not None:
            stages[-1][2] = s["end"]
    for name, start, end in stages:
        if name in frozen:
            continue
        a = rec.policy_at.get(start)
        b = rec.policy_at.get(end) if end in rec.policy_at else (fingerprint(rec.final) if rec.final else None)
        if a is None or b is None:
            rep.expect("every stage moved the weights", False, f"stage {name}: its weights were not recorded")
            continue
        rep.expect("every stage moved the weights", a != b,
                   f"stage {name}: the weights did not move over its {end - start} step(s)")


def _check_frozen(v, rec, rep, events) -> None:
    """A segment (phase or stage) with train.freeze_policy: the policy's recorded weights at each of its steps' start
    and after its last step are those it started with (`frozen policy did not move`), and each critic's weights at
    its steps' start and after them differ (`frozen policy: the critic learned`); from the spec's segments and the
    recorded weights only."""
    from composer.referee.record import fingerprint

    last = max(rec.policy_at) if rec.policy_at else -1
    for seg in v.segments:
        if not seg.spec.train.freeze_policy:
            continue
        prints = [rec.policy_at[s] for s in range(seg.start, seg.end + 1) if s in rec.policy_at]
        if seg.end > last and rec.final is not None:  # the run ended with this segment
            prints.append(fingerprint(rec.final))
        rep.expect("frozen policy did not move", len(prints) >= 2 and len(set(prints)) == 1,
                   f"segment {seg.name} (train.freeze_policy): the policy's weights changed over steps "
                   f"{seg.start}-{seg.end - 1}" if len(prints) >= 2 else
                   f"segment {seg.name}: fewer than two recorded weights of the policy ({len(prints)})")
        states: dict = {}
        for kind, e in events:
            if kind == "critic_values" and seg.start <= e["step"] <= seg.end:
                states.setdefault(e["term"], []).append(e["state"])
            if kind == "critic_stepped" and seg.start <= e["step"] < seg.end:
                states.setdefault(e["term"], []).append(e["state"])
        moved = {t: any(any(not a[k].equal(b[k]) for k in a) for a, b in zip(xs, xs[1:])) for t, xs in states.items()}
        rep.expect("frozen policy: the critic learned", bool(moved) and all(moved.values()),
                   f"segment {seg.name} (train.freeze_policy): no critic's weights moved ({moved or 'no critic seen'})")
