"""The referee's optimiser step (DESIGN.md section 10): every update of a recorded run recomputed from the spec.

Around each optimiser update the recorder calls `UpdateWatch` (installed on the run's optimiser by
`composer/referee/record.py`), which keeps three comparisons, never the run's own settings:

  parameter gradient recomputed   the gradient the run accumulated before clipping, against
                                  sum_k w_k(step) J_k^T g_k - entropy_coef(step) * grad H: g_k is term k's gradient
                                  w.r.t. its log-probs (checked against the objective's formula by `loss gradient
                                  recomputed`), J_k a fresh forward of the weights before the update at the term's
                                  declared temperature, w_k the term's weight as the spec declares it at that step,
                                  H the mean entropy of the first batch's response tokens. A term whose loss reads
                                  logits (a full-vocabulary divergence) or a critic head's values (ppo's shared
                                  network) is not covered: its update is skipped.
  gradient clip as declared       torch's clip_grad_norm_ at the segment's train.grad_clip (0: none):
                                  g <- g * min(1, c / (||g|| + 1e-6)).
  optimizer step recomputed       AdamW (Loshchilov & Hutter 2019, arXiv 1711.05101; torch's form, eps 1e-8) on
                                  the referee's clip of the run's gradient, with the segment's betas and weight
                                  decay, the LR the spec declares (`lr_at`), and moments that start fresh where
                                  the spec says (`fresh_moments`): the predicted weights against the weights the
                                  run has after the update (`step_error`: each weight's difference beyond the
                                  rounding of its own float32 step, relative to the update's size; an update
                                  smaller than that rounding (a near-zero gradient: OAPL on an all-equal batch)
                                  is compared weight by weight at rounding, and noted when nothing moved beyond it).

Formulas are written here from the spec's field descriptions, not imported from the Plan or the backend.
"""

from __future__ import annotations

import copy
import math

from composer.origins import NEVER_LOSS

EPS = 1e-8  # torch.optim.AdamW's default (the spec does not expose it)
GRAD_TOL = 5e-3  # relative: float32 forwards of one batch in two layouts (flat vs padded)
STEP_TOL = 1e-3  # relative to the update's size: float32 AdamW against this float64 one


def segment(v, step: int):
    """The validated segment (phase or stage) that global step `step` belongs to (the last one past the end)."""
    for seg in v.segments:
        if seg.start <= step < seg.end:
            return seg
    return v.segments[-1]


def lr_at(v, step: int) -> float:
    """train.lr of the segment in force, with its warm-up and schedule counted from the segment's start
    (train.warmup_steps: linear over the first steps, step k at (k + 1) / warmup of the peak; train.lr_schedule:
    constant, or cosine from the peak to 0 over the segment's steps after the warm-up)."""
    seg = segment(v, step)
    t = seg.spec.train
    local, length = step - seg.start, seg.end - seg.start
    factor = min(1.0, (local + 1) / t.warmup_steps) if t.warmup_steps else 1.0
    if t.lr_schedule == "cosine":
        frac = min(max(local - t.warmup_steps, 0) / max(length - t.warmup_steps, 1), 1.0)
        factor *= 0.5 * (1.0 + math.cos(math.pi * frac))
    return t.lr * factor


def fresh_moments(v, step: int) -> bool:
    """Whether AdamW's moments and step count start fresh before step `step`: the first step of a stage after
    the first (train.optimizer_at_stage: reset), or every train.reset_every steps of a segment counted from its
    start, when reset_what names the optimizer."""
    seg = segment(v, step)
    t = seg.spec.train
    if seg.stage is not None and step == seg.start > 0:
        first_of_stage = min(s.start for s in v.segments if s.stage == seg.stage)
        if step == first_of_stage and t.optimizer_at_stage == "reset":
            return True
    local = step - seg.start
    return bool(t.reset_every and local > 0 and local % t.reset_every == 0 and "optimizer" in t.reset_what)


def clip(grads: dict, max_norm: float) -> dict:
    """clip_grad_norm_ (the global L2 norm over every tensor): g * min(1, max_norm / (norm + 1e-6))."""
    if not max_norm:
        return grads
    norm = math.sqrt(sum(float((g.double() ** 2).sum()) for g in grads.values()))
    coef = min(1.0, max_norm / (norm + 1e-6))
    return {n: g.double() * coef for n, g in grads.items()}


def adamw(state: dict, weights: dict, grads: dict, lr: float, betas, weight_decay: float) -> dict:
    """One AdamW step in float64 (torch's form): p <- p (1 - lr wd); m <- b1 m + (1 - b1) g;
    v <- b2 v + (1 - b2) g^2; p <- p - lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps).
    `state` (name -> [t, m, v]) is updated in place; returns the new weights."""
    import torch

    b1, b2 = betas
    out = {}
    for n, g in grads.items():
        g = g.double()
        t, m, sq = state.get(n, (0, torch.zeros_like(g), torch.zeros_like(g)))
        t, m, sq = t + 1, b1 * m + (1 - b1) * g, b2 * sq + (1 - b2) * g * g
        state[n] = (t, m, sq)
        p = weights[n].double() * (1 - lr * weight_decay)
        out[n] = p - (lr / (1 - b1 ** t)) * m / (sq.sqrt() / math.sqrt(1 - b2 ** t) + EPS)
    return out


def _rel(a: dict, b: dict, scale: float) -> float:
    import torch

    num = math.sqrt(sum(float(((a[n].double() - b[n].double()) ** 2).sum()) for n in a))
    return num / max(scale, 1e-30) if scale > 0 else (0.0 if num == 0 else float(torch.inf))


def _norm(d: dict) -> float:
    return math.sqrt(sum(float((x.double() ** 2).sum()) for x in d.values()))


def rounding(before: dict, after: dict) -> dict:
    """Per weight, what the run's own optimiser step may round off: eps of the weight's dtype (float32: 2^-23) times
    its magnitude, an upper bound on one unit in the last place (the decay's multiply and the update's add round
    once each, half a unit each). A weight whose update is below this may not move at all."""
    import torch

    return {n: torch.finfo(after[n].dtype).eps * torch.maximum(after[n].double().abs(), before[n].double().abs())
            for n in after}


def step_error(predicted: dict, before: dict, after: dict) -> tuple[float, bool]:
    """(err, resolved) of one optimiser step: err = ||max(|predicted - after| - rounding, 0)|| / ||after - before||,
    the predicted weights' distance to the run's beyond each weight's float32 rounding (`rounding`), relative to
    the update's size (0 where they agree to rounding, inf where the run did not move but should have); resolved:
    some weight's predicted move exceeds its rounding (else the step is below float32 resolution: any LR would
    give the same weights, and the check saw nothing). A relative error alone fails a correct step whose update is
    at rounding level (a near-zero gradient: OAPL on an all-zero-reward batch, AdamW's m / (sqrt(v) + eps) ~ g / eps)."""
    r = rounding(before, after)
    excess = moved = beyond = 0.0
    for n in after:
        a, b, p = after[n].double(), before[n].double(), predicted[n].double()
        excess += float((((p - a).abs() - r[n]).clamp(min=0) ** 2).sum())
        moved += float(((a - b) ** 2).sum())
        beyond += float((((p - b).abs() - r[n]).clamp(min=0) ** 2).sum())
    excess, moved = math.sqrt(excess), math.sqrt(moved)
    err = excess / moved if moved > 0 else (0.0 if excess == 0 else math.inf)
    return err, beyond > 0


class UpdateWatch:
    """Hooks on the run's optimiser and trainable parameters (see the module docstring). `results` holds one
    dict per update: step, grad_err (None when not covered), clip_err, step_err and resolved (`step_error`), fresh
    (moments reset), lr (the spec's)."""

    def __init__(self, v, optimizer, policy, events: list):
        from composer.checks.terms import terms  # the spec's terms and raw weights (no run state)

        self.v, self.events, self.terms = v, events, terms
        self.named = [(n, p) for n, p in policy.named_parameters() if p.requires_grad]
        self.model = copy.deepcopy(policy).eval()  # before the hooks: the copy carries none
        self.pre: dict = {}  # name -> the accumulated gradient before clipping
        self.state: dict = {}  # the referee's AdamW moments
        self.results: list[dict] = []
        self.active = True
        self.seen = 0  # events already assigned to an update
        self.last_step = None
        self.before = None
        for n, p in self.named:
            p.register_post_accumulate_grad_hook(lambda p, n=n: self._accumulated(n, p))
        optimizer.register_step_pre_hook(lambda opt, args, kwargs: self._before())
        optimizer.register_step_post_hook(lambda opt, args, kwargs: self._after())

    def _accumulated(self, name, p):
        if self.active:
            self.pre[name] = p.grad.detach().clone()

    def _before(self):
        # Lightning's automatic optimisation runs the step's closure (loss, backward, clip) inside the optimiser's
        # step, after this hook: only the weights are taken here (the closure does not change them)
        if self.active:
            self.before = {n: p.detach().clone() for n, p in self.named}

    def _after(self):
        if not self.active:
            return
        terms = [e for k, e in self.events[self.seen:] if k == "term_loss"]
        self.seen = len(self.events)
        step = terms[-1]["step"] if terms else (self.last_step if self.last_step is not None else 0)
        first_update = step != self.last_step
        self.last_step = step
        seg = segment(self.v, step)
        t = seg.spec.train
        before, self.before = self.before, None
        after = {n: p.detach().clone() for n, p in self.named}
        grads = {n: self.pre.get(n, p.detach() * 0) for n, p in self.named}  # accumulated, before the clip
        ran_clipped = {n: (p.grad.detach().clone() if p.grad is not None else p.detach() * 0) for n, p in self.named}
        self.pre = {}
        fresh = first_update and fresh_moments(self.v, step)
        if fresh:
            self.state = {}
        mine = clip(grads, t.grad_clip)
        lr = lr_at(self.v, step)
        predicted = adamw(self.state, before, mine, lr, t.betas, t.weight_decay)
        step_err, resolved = step_error(predicted, before, after)
        self.results.append({"step": step, "fresh": fresh, "lr": lr, "step_err": step_err, "resolved": resolved,
                             "clip_err": _rel(mine, ran_clipped, _norm(ran_clipped)),
                             "grad_err": self._grad_err(terms, step, seg.spec, before, grads)})

    def _grad_err(self, terms, step, spec, before, grads):
        """||predicted - run's|| / ||run's|| for this update's gradient before clipping; None when a term reads
        logits (not covered) or no term left a log-prob gradient."""
        import torch

        from composer.lang.curves import reference_value

        if not terms or any(e["grad"] is None and e["objective"].wants_logits for e in terms) or \
                any(e["objective"].wants_logits for e in terms):
            return None
        if any(getattr(e["view"], "values", None) is not None for e in terms):  # a critic head on the policy's
            return None  # network: its value loss reaches the weights through the values, not the log-probs
        weight = {n: w for n, _s, _o, w in self.terms(spec)}
        self.model.load_state_dict({**self.model.state_dict(), **before}, strict=False)
        params = dict(self.model.named_parameters())
        for n, p in params.items():
            p.requires_grad_(n in grads)
        total = 0.0
        forwards: dict = {}
        for i, e in enumerate(terms):
            b, temp = e["batch"], e["temperature"]
            key = (id(b.tokens), temp)
            if key not in forwards:
                forwards[key] = _logprobs_entropy(self.model, b.tokens.cpu(), b.attention_mask.cpu(), temp)
            lp, ent = forwards[key]
            if e["grad"] is not None:
                total = total + float(reference_value(weight[e["term"]], step)) * (lp * e["grad"].to(lp.dtype)).sum()
            if i == 0:
                coef = float(reference_value(spec.train.entropy_coef, step))
                if coef:
                    m = (b.response_mask & b.attention_mask.bool() & ~b.mask(NEVER_LOSS)).cpu()  # not the environment's
                    total = total - coef * (ent * m).sum() / m.sum().clamp(min=1)
        if not torch.is_tensor(total):
            return None
        names = [n for n in grads if n in params]
        got = torch.autograd.grad(total, [params[n] for n in names], allow_unused=True)
        want = {n: (g if g is not None else torch.zeros_like(params[n])).detach() for n, g in zip(names, got)}
        run = {n: grads[n] for n in names}
        return _rel(want, run, _norm(run))


def _logprobs_entropy(model, tokens, attention_mask, temperature: float):
    """[B, T] log p(tokens[b, t] | tokens[b, :t]) at `temperature` and the entropy of that distribution, with
    gradients (0 at t = 0)."""
    import torch

    logits = model(input_ids=tokens, attention_mask=attention_mask.long()).logits.float() / temperature
    lp_all = torch.log_softmax(logits[:, :-1], -1)
    lp = lp_all.gather(-1, tokens[:, 1:, None]).squeeze(-1)
    ent = -(lp_all.exp() * lp_all).sum(-1)
    pad = torch.zeros(tokens.shape[0], 1)
    return torch.cat([pad, lp], 1), torch.cat([pad, ent], 1)


def check_updates(rep, watch) -> None:
    """The three rows of every recorded update (see the module docstring), and one that some update was checked."""
    if watch is None:
        return
    covered = 0
    for r in watch.results:
        s = r["step"]
        if r["grad_err"] is not None:
            covered += 1
            rep.expect("parameter gradient recomputed", r["grad_err"] <= GRAD_TOL,
                       f"step {s}: the gradient the run applied differs from the terms' weighted log-prob gradients "
                       f"(and the entropy bonus) back-propagated through the weights (by {r['grad_err']:.3g} relative)")
        rep.expect("gradient clip as declared", r["clip_err"] <= 1e-5,
                   f"step {s}: the clipped gradient is not clip_grad_norm_ at train.grad_clip "
                   f"(off by {r['clip_err']:.3g} relative)")
        rep.expect("optimizer step recomputed", r["step_err"] <= STEP_TOL,
                   f"step {s}: the weights after the update are not AdamW's at the declared LR {r['lr']:.3g}, "
                   f"betas and weight decay with moments {'fresh' if r['fresh'] else 'carried'} (off by "
                   f"{r['step_err']:.3g} of the update, beyond each weight's float32 rounding)")
    rep.expect("saw optimizer updates", bool(watch.results), "no optimizer update was recorded")
    resets = [r["step"] for r in watch.results if r["fresh"]]
    small = [r["step"] for r in watch.results if not r.get("resolved", True)]
    rep.note("optimizer step recomputed", f"{len(watch.results)} updates"
             + (f", moments fresh before step(s) {sorted(set(resets))}" if resets else "")
             + (f"; not exercised at step(s) {sorted(set(small))}: the update is below the weights' float32 rounding "
                "(a near-zero gradient)" if small else ""))
    if watch.results and len(small) == len(watch.results):
        rep.expect("optimizer step exercised", False,
                   f"not exercised: all {len(small)} updates were below the weights' float32 rounding (near-zero "
                   "gradients: no reward signal?), so no learning rate could be told apart")
    if watch.results:
        rep.note("parameter gradient recomputed", f"{covered} of {len(watch.results)} updates (the rest read logits "
                 "or a critic head's values)" if covered < len(watch.results) else f"{covered} updates")
