"""The referee's checks of a learned critic (PPO) and of a reward-model source (DESIGN.md section 10), from the spec
and the recorded inputs only. The formulas of GAE and the policy loss are the objective's own (`reference_gae`,
`reference_policy_loss` in components/objectives/ppo.py), the value loss the critic's (`reference_value_loss` in
components/objectives/critic.py); this module recomputes their inputs (fresh forwards of the recorded weights):

  critic values      V(tokens[:t]) by a fresh forward of the critic's recorded weights (own network: its copy; a head
                     on the policy: the policy's recorded weights and the head's) = the old values the run used
  critic start       an own network without `model` starts as the policy's backbone at its first use
  critic moved       its weights at each step's start differ from the step before's (a frozen critic fails)
  rewards            the verifier's verdicts, or the reward model's score by a fresh forward of its checkpoint on the
                     declared input (the rollout's ids, or the text re-rendered with its own tokenizer and template),
                     at the last non-padding token, normalised as declared
  GAE                r_t = -beta k(log pi_behaviour - log pi_ref) + R at the last action (the reference by a fresh
                     forward of the stage's starting weights), delta, A, G row by row in float64, the whitening over
                     the step's action tokens = the run's advantages and returns
  value loss         each critic update: 0.5 max((V - G)^2, (V_old + clip(V - V_old) - G)^2), token mean, with V a
                     fresh forward of the critic's weights before that update: its value and its gradient w.r.t. V
  critic step        the parameter gradient J^T dL/dV (a fresh forward with gradient), its clip at train.grad_clip and
                     AdamW at critic.lr (else train.lr) with train's program: the weights after the step
  policy loss        -min(rho A_t, clip(rho) A_t) with the referee's A_t: value and gradient w.r.t. the log-probs
A run whose critic never moved, or whose value clip was never checked, fails with the counts.
"""

from __future__ import annotations

import math

from composer.referee.record import fresh_logprobs, row_key, segment_spec

VALUE_TOL = 2e-4  # float32 forward passes of one network, shapes apart


def _terms_with_critics(spec):
    from composer.checks.terms import terms

    return {n: o for n, _s, o, _w in terms(spec) if o is not None and o.value_model() is not None}


def _action_mask(plan, step: int, term: str, b):
    from composer.referee.checks import loss_origins

    m = (b.mask(loss_origins(plan, step, term)) & b.attention_mask.bool()).cpu()
    if b.row_mask is not None:  # a gate's rows (checked against the gate's formula by the main referee)
        m &= b.row_mask.cpu()[:, None]
    return m


def critic_resets(v) -> set:
    """The steps before which the spec declares every critic fresh: the first step of a stage after the first whose
    train.critic_at_stage is `reset` (from the validated segments, not the Plan)."""
    first: dict = {}
    for seg in v.segments:
        if seg.stage is not None:
            first.setdefault(seg.stage, seg)
    return {seg.start for seg in first.values() if seg.start > 0 and seg.spec.train.critic_at_stage == "reset"}


def referee_values(rec, e) -> "object":
    """[B, T] V(tokens[b, :t]) of event e's batch by a fresh forward of the recorded weights (0 at t = 0)."""
    import torch

    b = e["batch"]
    net = rec.critic_scratch[e["term"]]
    net.load_state_dict(e["state"])
    ids, mask = b.tokens.cpu(), b.attention_mask.long().cpu()
    with torch.no_grad():
        if e["network"] == "own":
            inner = getattr(net, net.base_model_prefix)
            h = inner(input_ids=ids.to(net.device), attention_mask=mask.to(net.device)).last_hidden_state
            v = (h.float() @ net.score.weight.float().T)[..., 0].cpu()
        else:
            policy = rec.scratch
            policy.load_state_dict(e["policy_state"] if "policy_state" in e else rec.weights_at[e["step"]])
            inner = getattr(policy, policy.base_model_prefix)
            dev = next(policy.parameters()).device
            h = inner(input_ids=ids.to(dev), attention_mask=mask.to(dev)).last_hidden_state
            v = (h.float() @ net.weight.float().T.to(dev))[..., 0].cpu()
    out = torch.zeros(ids.shape)
    out[:, 1:] = v[:, :-1]
    return out


# ------------------------------------------------------------------------------------------------ reward models

def _reward_model(cache: dict, src):
    """(model, tokenizer) of a reward_model source's checkpoint, loaded here with transformers."""
    if src.model not in cache:
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        from composer.runtime.models import resolve

        path = resolve(src.model)
        cache[src.model] = (AutoModelForSequenceClassification.from_pretrained(path).eval(),
                            AutoTokenizer.from_pretrained(path))
    return cache[src.model]


def reward_model_rewards(rec, step: int, source: str, b) -> list | None:
    """The rewards reward_model source `source` gave b's rows at `step`, recomputed: its raw score of every rollout of
    each step, in step order (`referee_rm_scores`), normalised as declared (running: Welford over every score of
    the steps so far, the step's own included). None when a row of b is not a rollout of `step`."""
    table = getattr(rec, "rm_table", None)
    if table is None:
        table = rec.rm_table = {}
        cache: dict = {}
        running: dict = {}
        for kind, e in rec.events:
            if kind != "rollout":
                continue
            spec = segment_spec(rec.v, e["segment"])
            for name, src in spec.sources.items():
                if not type(src).scored_by_model:
                    continue
                rb = e["batch"]
                raw = referee_rm_scores(rec, spec, src, rb, cache)
                if src.normalize == "config":
                    net, _ = _reward_model(cache, src)
                    m, sd = float(getattr(net.config, "mean", 0.0)), float(getattr(net.config, "std", 1.0))
                    want = [(x - m) / sd for x in raw]
                elif src.normalize == "running":
                    c = running.setdefault(name, [0, 0.0, 0.0])
                    for x in raw:
                        c[0] += 1
                        d = x - c[1]
                        c[1] += d / c[0]
                        c[2] += d * (x - c[1])
                    sd = math.sqrt(c[2] / c[0]) if c[0] > 1 else 1.0
                    want = [(x - c[1]) / max(sd, 1e-8) for x in raw]
                else:
                    want = raw
                rows = table.setdefault((e["step"], name), {})
                for i in range(rb.size):
                    rows.setdefault(row_key(rb, i), want[i])
    rows = table.get((step, source), {})
    out = [rows.get(row_key(b, i)) for i in range(b.size)]
    return None if any(x is None for x in out) else out


def referee_rm_scores(rec, spec, src, b, cache) -> list[float]:
    """The reward model's raw score of each row: its declared input, a fresh forward, the head at the last real token."""
    import torch

    from composer.prompts import prompt_format

    net, tok = _reward_model(cache, src)
    n_tok = b.attention_mask.sum(1).tolist()
    if src.input == "tokens":
        seqs = [b.tokens[i, : n_tok[i]].tolist() for i in range(b.size)]
    else:
        fmt = prompt_format(spec.data, rec.tokenizer)
        resp = b.response_mask
        seqs = []
        for i in range(b.size):
            text = rec.tokenizer.decode(b.tokens[i][resp[i]].tolist(), skip_special_tokens=True)
            ex = b.examples[i]
            if getattr(tok, "chat_template", None):
                msgs = ([{"role": "system", "content": fmt.system}] if fmt.system is not None else []) + \
                    [{"role": "user", "content": fmt.user(ex)}, {"role": "assistant", "content": text}]
                s = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=False)
                seqs.append(tok.encode(s, add_special_tokens=False))
            else:
                seqs.append(tok.encode(ex.prompt + text, add_special_tokens=True))
    out = []
    for ids in seqs:
        with torch.no_grad():
            x = torch.tensor([ids])
            h = getattr(net, net.base_model_prefix)(input_ids=x).last_hidden_state
            out.append(float((h[0, -1].float() @ net.score.weight.float().T)[0]))
    return out


# ------------------------------------------------------------------------------------------------ the checks

def check_critics(v, plan, rec, rep, events, term_events) -> None:
    """Every check of the module docstring, over the recorded events of terms whose objective has a critic."""
    import torch

    from composer.referee.checks import stage_start

    critic_terms = {n for seg in v.segments for n in _terms_with_critics(seg.spec)}
    if not critic_terms:
        return
    resets = critic_resets(v)
    seen = {"values": 0, "gae": 0, "updates": 0, "clip_bound": 0, "clip_tokens": 0, "policy": 0, "moved": 0,
            "heads": 0}
    want_of: dict = {}  # (step, term) -> {row key: (A row, G row, V_old row)}
    states: dict = {}  # term -> [(step, state)]
    for kind, e in events:
        if kind != "critic_values":
            continue
        step, term, b = e["step"], e["term"], e["batch"]
        spec = segment_spec(v, e["segment"])
        obj = _terms_with_critics(spec)[term]
        mask = _action_mask(plan, step, term, b)
        fresh = referee_values(rec, e)
        err = float((fresh - b.values.detach().cpu()).abs()[mask].max()) if mask.any() else 0.0
        rep.expect("critic values recomputed", err <= VALUE_TOL,
                   f"step {step} {term}: the old values are not the critic's recorded weights' (off by {err:.3g})")
        seen["values"] += 1
        states.setdefault(term, []).append((step, e["state"]))
        crit = obj.value_model()
        if (len(states[term]) == 1 or step in resets) and e["network"] == "own" and crit.model is None \
                and step in rec.weights_at:
            policy = rec.weights_at[step]
            prefix = rec.critic_scratch[term].base_model_prefix + "."
            keys = [k for k in e["state"] if k.startswith(prefix)]
            same = bool(keys) and all(k in policy and torch.equal(e["state"][k], policy[k]) for k in keys)
            rep.expect("critic starts from the policy's weights", same,
                       f"step {step} {term}: the critic's backbone is not the policy's weights at its first use"
                       + (" (a stage's start with train.critic_at_stage: reset)" if step in resets else ""))
        # GAE from the fresh values, the rewards, the fresh reference
        ref = None
        if obj.kl_coef:
            start = stage_start(plan, spec, step)
            if start not in rec.weights_at:
                rep.expect("GAE advantages recomputed", False, f"step {step}: no recorded reference weights")
                continue
            ref = fresh_logprobs(rec.weights(start), b.tokens.cpu(), b.attention_mask.cpu(),
                                 float(spec.rollout.temperature)).double()
        A, G = obj.reference_gae(b.rewards.detach().cpu().double().tolist(), b.behavior_logprobs, ref, fresh.double(),
                                 mask)  # the objective's own formula (its file)
        if b.advantages is None or b.returns is None:
            rep.expect("GAE advantages recomputed", False, f"step {step} {term}: the batch has no advantages")
            continue
        errA = float((A - b.advantages.detach().cpu().double()).abs()[mask].max()) if mask.any() else 0.0
        errG = float((G - b.returns.detach().cpu().double()).abs()[mask].max()) if mask.any() else 0.0
        scale = 1.0 + (float(A[mask].abs().max()) if mask.any() else 0.0)
        rep.expect("GAE advantages recomputed", errA <= 1e-3 * scale,
                   f"step {step} {term}: advantages differ from GAE(gamma {obj.gamma:g}, {obj.lambda_words()}) with "
                   f"{obj.whiten} whitening by {errA:.3g}")
        rep.expect("GAE returns recomputed", errG <= 1e-3 * (1 + float(G[mask].abs().max()) if mask.any() else 1),
                   f"step {step} {term}: returns differ from G = A + V_old (A^c + V_old, A^c at critic_lambda "
                   f"{obj.critic_lambda}, where it is set) by {errG:.3g}")
        seen["gae"] += 1
        rows = {}
        for i in range(b.size):
            rows[row_key(b, i)] = (A[i], G[i], fresh[i])
        want_of[(step, term)] = rows

    # the critic moved between steps (a frozen critic: same state at every step's start)
    for term, seq in states.items():
        for (s0, a), (s1, c) in zip(seq, seq[1:]):
            moved = any(not torch.equal(a[k], c[k]) for k in a)
            rep.expect("critic moved", moved, f"{term}: the critic's weights at step {s1} are those of step {s0}")
            seen["moved"] += moved

    # each update of an own network: the value loss and its gradient w.r.t. the values
    for kind, e in events:
        if kind != "critic_update":
            continue
        step, term, b = e["step"], e["term"], e["batch"]
        spec = segment_spec(v, e["segment"])
        obj = _terms_with_critics(spec)[term]
        rows = want_of.get((step, term))
        if rows is None:
            rep.expect("value loss recomputed", False, f"step {step} {term}: no recorded old values for its update")
            continue
        keys = [row_key(b, i) for i in range(b.size)]
        if any(k not in rows for k in keys):
            rep.expect("value loss recomputed", False, f"step {step} {term}: update rows not in the step's rollout")
            continue
        mask = _action_mask(plan, step, term, b)
        V = referee_values(rec, e).double()
        verr = float((V - e["values"].double()).abs()[mask].max()) if mask.any() else 0.0
        rep.expect("critic values recomputed", verr <= VALUE_TOL,
                   f"step {step} {term} update {e['update']}: the values are not the critic's recorded weights'")
        T = b.tokens.shape[1]
        G = torch.stack([rows[k][1][:T] for k in keys])
        old = torch.stack([rows[k][2][:T].double() for k in keys])
        eps = obj.value_model().value_clip
        n = max(int(mask.sum()), 1)  # the action tokens the value loss averages over
        value, want, bound = obj.value_model().reference_value_loss(V, G, old, mask)  # the critic's own formula
        rep.expect("value loss recomputed", abs(value - e["loss_value"]) <= 1e-4 * (1 + abs(value)),
                   f"step {step} {term} update {e['update']}: value loss {e['loss_value']:.6g}, the formula's "
                   f"{value:.6g} (value clip {eps})")
        if e.get("values_grad") is not None:
            gerr = float((want - e["values_grad"].double()).abs().max()) * n
            rep.expect("value loss gradient recomputed", gerr <= 5e-3,
                       f"step {step} {term} update {e['update']}: d loss / d V differs from the formula's by {gerr:.3g} "
                       "per token")
        seen["updates"] += 1
        seen["clip_tokens"] += int(mask.sum())
        seen["clip_bound"] += int((bound & mask).sum())

    # the critic's own optimizer: the parameter gradient of the value loss, its clip, AdamW with the declared lr
    _check_critic_steps(v, plan, rec, rep, events, want_of, seen)

    # the policy loss with the referee's per-token advantages
    n_seen: dict = {}
    for e in term_events:
        term, step, b, obj = e["term"], e["step"], e["batch"], e["objective"]
        if term not in critic_terms or e["grad"] is None:
            continue
        rows = want_of.get((step, term))
        keys = [row_key(b, i) for i in range(b.size)]
        if rows is None or any(k not in rows for k in keys):
            rep.expect("policy loss recomputed (critic)", False, f"step {step} {term}: rows without advantages")
            continue
        T = b.tokens.shape[1]
        A = torch.stack([rows[k][0][:T] for k in keys])
        mask = _action_mask(plan, step, term, b)
        cur = e["view"].logprobs.detach().cpu().double()
        old = (b.old_logprobs if b.old_logprobs is not None else b.behavior_logprobs).detach().cpu().double()
        value, dvalue, w = obj.reference_policy_loss(A, cur, old, mask)  # the objective's own formula (its file)
        grad = e["grad"].double()
        gerr = float((dvalue - grad).abs().max()) / float(w[mask].max()) if mask.any() else 0.0
        rep.expect("policy loss gradient recomputed (critic)", gerr <= 5e-3,
                   f"step {step} {term}: d loss / d log pi differs from the clipped surrogate with GAE advantages by "
                   f"{gerr:.3g} per unit")
        extra = 0.0
        if obj.value_model().network == "shared":  # the value loss inside the policy's loss
            key = (step, term, id(b.tokens))
            n_seen[key] = n_seen.get(key, 0) + 1  # the k-th loss of this batch reads the k-th recorded head
            head = [x for k, x in events if k == "critic_head" and x["step"] == step and x["term"] == term
                    and x["batch"].tokens is b.tokens]
            if len(head) < n_seen[key]:
                rep.expect("policy loss recomputed (critic)", False, f"step {step} {term}: no recorded critic head")
                continue
            h = head[n_seen[key] - 1]
            V = referee_values(rec, h).double()
            G = torch.stack([rows[k][1][:T] for k in keys])
            old_v = torch.stack([rows[k][2][:T].double() for k in keys])
            head_loss, _dv, _bound = obj.value_model().reference_value_loss(V, G, old_v, mask)  # the critic's formula
            extra = obj.value_model().value_coef * head_loss
            seen["heads"] += 1
        rep.expect("policy loss recomputed (critic)", abs(e["loss_value"] - value - extra) <= 1e-4 * (1 + abs(value)),
                   f"step {step} {term}: loss {e['loss_value']:.6g}, the formula's {value + extra:.6g}")
        seen["policy"] += 1
        rep.checked[term] = rep.checked.get(term, 0) + 1  # coverage: a loss recomputed from the part's own reference

    own = any(o.value_model().network == "own" for seg in v.segments for o in _terms_with_critics(seg.spec).values())
    rep.expect("saw critic values", seen["values"] and seen["gae"], f"no critic value or GAE checked: {seen}")
    if own:
        rep.expect("saw value updates", seen["updates"], "no value update checked")
        rep.expect("saw critic steps", seen.get("critic_steps"), "no optimizer step of the critic checked")
        rep.expect("critic moved", seen["moved"], f"the critic never moved: {seen}")
    rep.expect("saw policy losses (critic)", seen["policy"], f"no policy loss checked: {seen}")
    rep.note("saw value updates", f"{seen['updates']} updates; the value clip bound on {seen['clip_bound']} of "
             f"{seen['clip_tokens']} tokens; {seen['heads']} shared-head losses")


def _check_critic_steps(v, plan, rec, rep, events, want_of, seen) -> None:
    """Each update of an own critic: `critic gradient recomputed` (J^T dL/dV, J a fresh forward of the weights before
    the update with gradient, dL/dV the value loss's formula, against the gradient the run's step read before its
    clip), `critic step recomputed` (composer/referee/optim.py's clip at train.grad_clip and AdamW at critic.lr, else
    train.lr, with train's warm-up and decay, betas and weight decay, moments from the critic's first update: the
    predicted weights against the weights the run had after the step)."""
    import copy

    import torch

    from composer.referee.optim import GRAD_TOL, STEP_TOL, _norm, _rel, adamw, clip, lr_at, step_error

    by_key: dict = {}
    for kind, e in events:
        if kind in ("critic_update", "critic_grads", "critic_stepped"):
            by_key.setdefault((e["step"], e["term"], e["update"]), {})[kind] = e
    moments: dict = {}  # term -> the referee's AdamW state
    grad_nets: dict = {}
    resets = critic_resets(v)
    for (step, term, k), parts in sorted(by_key.items(), key=lambda x: (x[0][0], x[0][2])):
        if step in resets and k == 0:  # a fresh critic (train.critic_at_stage: reset): fresh AdamW moments
            moments.pop(term, None)
        u, g, after = parts.get("critic_update"), parts.get("critic_grads"), parts.get("critic_stepped")
        if u is None or g is None or after is None or u["network"] != "own":
            continue
        spec = segment_spec(v, u["segment"])
        obj = _terms_with_critics(spec)[term]
        b = u["batch"]
        rows = want_of.get((step, term))
        keys = [row_key(b, i) for i in range(b.size)]
        if rows is None or any(key not in rows for key in keys):
            continue
        if term not in grad_nets:
            grad_nets[term] = copy.deepcopy(rec.critic_scratch[term]).train()
        net = grad_nets[term]
        net.load_state_dict(u["state"])
        params = dict(net.named_parameters())
        for p in params.values():
            p.requires_grad_(True)
        mask = _action_mask(plan, step, term, b)
        inner = getattr(net, net.base_model_prefix)
        h = inner(input_ids=b.tokens.cpu(), attention_mask=b.attention_mask.long().cpu()).last_hidden_state
        raw = (h @ net.score.weight.T)[..., 0]
        V = torch.cat([raw.new_zeros(raw.shape[0], 1), raw[:, :-1]], 1)  # [B, T]
        T = b.tokens.shape[1]
        G = torch.stack([rows[key][1][:T] for key in keys]).to(V.dtype)
        old = torch.stack([rows[key][2][:T] for key in keys]).to(V.dtype)
        eps = obj.value_model().value_clip
        Vd = V.detach()
        if eps is None:
            dtok = Vd - G
        else:
            Vc = old + (Vd - old).clamp(-eps, eps)
            bound = (Vc - G) ** 2 > (Vd - G) ** 2
            dtok = torch.where(bound, (Vc - G) * ((Vd - old).abs() < eps), Vd - G)
        n = max(int(mask.sum()), 1)
        coef = torch.where(mask, dtok / n, torch.zeros_like(dtok))
        names = list(g["grads"])
        got = torch.autograd.grad((V * coef).sum(), [params[x] for x in names], allow_unused=True)
        want = {x: (gx if gx is not None else torch.zeros_like(params[x])).detach() for x, gx in zip(names, got)}
        run = g["grads"]
        gerr = _rel(want, run, _norm(run))
        rep.expect("critic gradient recomputed", gerr <= GRAD_TOL,
                   f"step {step} {term} update {k}: the critic's parameter gradient differs from J^T dL/dV of the value "
                   f"loss by {gerr:.3g} (relative)")
        t = spec.train
        crit = obj.value_model()
        lr = lr_at(v, step) * ((crit.lr / t.lr) if crit.lr is not None else 1.0)
        mine = clip(run, t.grad_clip)
        before = {x: u["state"][x] for x in names}
        predicted = adamw(moments.setdefault(term, {}), before, mine, lr, t.betas, t.weight_decay)
        serr, _resolved = step_error(predicted, before, {x: after["state"][x] for x in names})
        rep.expect("critic step recomputed", serr <= STEP_TOL,
                   f"step {step} {term} update {k}: the critic's weights after its step differ from AdamW (lr {lr:g}, "
                   f"clip {t.grad_clip:g}) by {serr:.3g} of the step's size")
        seen["critic_steps"] = seen.get("critic_steps", 0) + 1
