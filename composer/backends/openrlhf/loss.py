"""Where OpenRLHF runs the composer's step (composer/step.py): part 2 in its experience maker, part 3 in its actor loss.

Everything here is torch over plain tensors (no OpenRLHF import), so it runs on CPU in the tests. This module only
moves data between OpenRLHF's Experience and the composer's TrajectoryBatch (composer/backends/openrlhf/batch.py);
every quantity is composer/step.py's, over the Plan at the step (`Plan.at`):
  - the experience maker sees the whole step's samples (`prepare_step`): each term's advantages over full groups,
    its gate's and the rollout filter's rows (`step.row_masks`), each self-teacher's privileged prompt (the source's
    `teacher_prompts`) and each term's step-wide normaliser, carried to the loss in Experience.info and the labels;
  - the actor's training step sees a micro-batch (`ComposerLoss`): the term batches are rebuilt from the Experience
    and `step.loss` sums the terms' losses, each scaled by the micro-batch's share of its step-wide normaliser
    (`step.shares`), so micro-batches and DP ranks add up to the loss of the whole step.
"""

from __future__ import annotations

import dataclasses

from composer import step as the_step
from composer.backends.openrlhf.batch import decode_label, shift, to_batch
from composer.batch import PolicyView, TrajectoryBatch
from composer.lazy import F, torch
from composer.origins import CODE


def step_of(labels) -> int:
    """The trainer step a batch was sampled at (put into every label when prompts are dispatched)."""
    return int(decode_label(labels[0]).get("step", 0)) if len(labels) else 0


# ------------------------------------------------------------------------------------ teacher scores

def prompt_lengths(batch_or_origin) -> list[int]:
    """P_i: tokens before the first response token of each row."""
    origin = batch_or_origin.origin if isinstance(batch_or_origin, TrajectoryBatch) else batch_or_origin
    resp = (origin != CODE["prompt"]) & (origin != CODE["pad"])
    first = torch.where(resp.any(1), resp.float().argmax(1), (origin != CODE["pad"]).sum(1))
    return first.tolist()


# ----------------------------------------------------------------------------------------- the loss

def take_step_inputs(info: dict) -> tuple[dict, dict]:
    """Pop what the advantage step left in a micro-batch's Experience.info: per-term advantages [b] and the
    step's normaliser of each term (the same value in every row) -> (advantages, normalisers)."""
    advs, norms = {}, {}
    for key in [k for k in info if k.startswith("composer/adv") and k[len("composer/adv"):].isdigit()]:
        v = info.pop(key)
        advs[int(key[len("composer/adv"):])] = torch.stack(list(v)) if isinstance(v, list) else v
    for key in [k for k in info if k.startswith("composer/norm") and k[len("composer/norm"):].isdigit()]:
        v = info.pop(key)
        norms[int(key[len("composer/norm"):])] = float(v[0])
    return advs, norms


def step_inputs(experience) -> tuple[dict, dict]:
    """take_step_inputs once per Experience object. OpenRLHF collates a fresh Experience (and info) from its replay
    buffer for every pass of --train.max_epochs, so each pass finds them; they are also kept on the object, so a
    second loss call on one Experience (whose info no longer holds them) gets the same ones."""
    kept = getattr(experience, "_composer_step_inputs", None)
    if kept is None:
        kept = take_step_inputs(experience.info)
        experience._composer_step_inputs = kept
    return kept


def term_batches(at, batch: TrajectoryBatch, metas: list[dict]) -> list[TrajectoryBatch]:
    """One view of `batch` per term of the Plan at the step, as the advantage step marked it in the labels: a teacher
    term's rows weighted by its teacher's s_i (SDPO's rows with no signal), which only that teacher's terms read
    (labels carry `teacher_weight` per teacher), and a term's row mask (its gate, the rollout filter)."""
    out = []
    for term in at.terms:
        b = batch
        name = term.signal.teacher_source
        tw = [m.get("teacher_weight", {}).get(name) for m in metas] if name is not None else []
        if any(w is not None for w in tw):
            s_i = torch.tensor([1.0 if w is None else float(w) for w in tw], device=batch.tokens.device)
            b = dataclasses.replace(batch, seq_weight=batch.weights() * s_i)
        gate = [m.get("gate", {}).get(str(term.index)) for m in metas]  # the advantage step's row masks
        if any(g is not None for g in gate):
            b = dataclasses.replace(b, row_mask=torch.tensor([g is not False for g in gate], device=batch.tokens.device))
        out.append(b)
    return out


class ComposerLoss:
    """Drop-in for OpenRLHF's PolicyLoss (same call and return values): composer/step.py's part 3 on one micro-batch.
    The training-step patch puts the current Experience (and the student's / teachers' logits when wanted) into
    `self.ctx` first."""

    def __init__(self, plan, plugin: dict):
        self.plan, self.plugin = plan, plugin  # plan: composer.plan.plan.Plan of this run's segments
        self.ctx: dict = {}

    def at(self, experience):
        """The Plan at the step this Experience was sampled at (its labels carry the run's step)."""
        return self.plan.at(self.plan.offset + step_of(experience.labels))

    def batches(self, at, log_probs, action_mask, rollout_log_probs) -> list[TrajectoryBatch]:
        """One TrajectoryBatch per term for the Experience in ctx."""
        exp = self.ctx["experience"]
        base = exp.base_action_log_probs
        batch = to_batch(exp.sequences, exp.attention_mask, action_mask, exp.prompts, exp.labels,
                         rollout_log_probs=rollout_log_probs, rewards=exp.rewards, trainable_only=True)
        if base is not None and self.plugin.get("ref") == "initial":
            batch.initial_logprobs = shift(base.float())
        out = term_batches(at, batch, [decode_label(x) for x in exp.labels])
        for k, (term, b) in enumerate(zip(at.terms, out)):
            name = term.signal.teacher_source
            if name is None:
                continue
            t = self.ctx.get("teachers", {}).get(name)
            if t is not None:  # a self-teacher scored in the training step
                out[k] = dataclasses.replace(b, teacher_logprobs=t[0], teacher_logits=t[1])
            elif base is not None:  # an external teacher in the reference slot
                out[k] = dataclasses.replace(b, teacher_logprobs=shift(base.float()))
        return out

    def __call__(self, log_probs, old_log_probs, advantages, action_mask=None, rollout_log_probs=None, dp_size=1,
                 batch_num_tokens=None, global_batch_size=None):
        exp = self.ctx["experience"]
        at = self.at(exp)
        batches = self.batches(at, log_probs, action_mask, rollout_log_probs)
        # several passes, or a term that reads the trainer's own (a rollout correction): the ratio's denominator is the
        # actor's log-prob of the make-experience step
        wants = at.spec.train.epochs > 1 or any(t.objective.wants_old for t in at.terms)
        old = shift(old_log_probs.float()) if wants else None
        advs = self.ctx.get("advantages", {})
        batches = [dataclasses.replace(b, old_logprobs=old if old is not None else b.old_logprobs,
                                       advantages=None if advs.get(t.index) is None
                                       else advs[t.index].to(log_probs.device))
                   for t, b in zip(at.terms, batches)]
        logits = self.ctx.get("logits")
        view = PolicyView(shift(log_probs), logits=None if logits is None else shift(logits[:, :-1]))
        norms = self.ctx.get("norms", {})
        # DeepSpeed scales every micro-batch's backward by 1 / gas (gradient accumulation steps): x gas undoes it
        parts = dp_size * self.ctx.get("gas", 1)
        if norms:  # each term's micro-batch share of the step's normaliser: micro-batches and DP ranks add up
            shares = the_step.shares(the_step.normalisers(at, batches), norms, parts)
        else:  # no advantage step ran (it records the normalisers): a mean over the step's sequences
            rows = (action_mask.sum(-1) > 0).sum()
            shares = the_step.row_shares(at, rows, global_batch_size, dp_size) if global_batch_size is not None \
                else None
        # OpenRLHF adds its own entropy bonus (--actor.entropy_coef): the composer's loss leaves it out
        loss, metrics = the_step.loss(at, batches, lambda b, want, read: view, shares, facts=False, entropy=False)
        metrics.update(the_step.gate_facts(at, batches))  # the gate's share of this micro-batch's rows
        for k, v in metrics.items():
            exp.info[f"composer/{k}"] = torch.tensor(float(v))
        if not getattr(loss, "requires_grad", False):  # no loss token in this micro-batch: a zero with a graph
            loss = loss + 0.0 * log_probs.sum()
        m = action_mask.bool()  # OpenRLHF's ppo_kl: the mean (old - current) log-prob over the action tokens
        ppo_kl = ((old_log_probs - log_probs).detach() * m).sum() / m.sum().clamp(min=1)
        zero = torch.zeros((), device=log_probs.device)
        return loss, zero, ppo_kl, None, None


# ------------------------------------------------------------------------------- the make-experience step

def _pad_cat(tensors, value=0):
    """Right-pad [b_k, T_k] tensors to one width and concatenate -> [sum b_k, max T_k]."""
    T = max(t.shape[1] for t in tensors)
    return torch.cat([F.pad(t, (0, T - t.shape[1]), value=value) for t in tensors])


def step_batch(experiences, pad_id: int, trainable_only: bool = False, metas: list[dict] | None = None) -> TrajectoryBatch:
    """One TrajectoryBatch over every sample of a step (all micro-batches of the experience maker), with
    the real advantage groups (prompt x guide tag); `metas` replaces the labels' contents when given."""
    from composer.backends.openrlhf.batch import encode_label, group_ids

    prompts = [p for e in experiences for p in e.prompts]
    labels = [x for e in experiences for x in e.labels]
    if metas is not None:
        labels = [encode_label(m) for m in metas]
    rlp = [e.rollout_log_probs for e in experiences]
    rewards = [e.rewards for e in experiences]
    return to_batch(_pad_cat([e.sequences for e in experiences], pad_id),
                    _pad_cat([e.attention_mask for e in experiences]), _pad_cat([e.action_mask for e in experiences]),
                    prompts, labels,
                    rollout_log_probs=None if any(x is None for x in rlp) else _pad_cat(rlp),
                    rewards=None if any(x is None for x in rewards) else torch.cat([r.reshape(-1) for r in rewards]),
                    group=group_ids(prompts, [decode_label(x) for x in labels]), trainable_only=trainable_only)


def teacher_prompts(spec, name: str, batch: TrajectoryBatch, tokenizer, task):
    """(prompt token ids or None, weight) per row for the self-teacher `name`, over the whole step: the source's own
    context rules and templates (its `teacher_prompts`, as on Lightning)."""
    from composer.runtime.context import RunContext

    ctx = RunContext(task=task, tokenizer=tokenizer, policy=None, engine=None, spec=spec)
    return spec.sources[name].teacher_prompts(ctx, name, batch)


def prepare_step(experiences, plan, plugin: dict, tokenizer, task) -> None:
    """composer/step.py's part 2 over the whole step's experiences (in place): per-term advantages into
    `info['composer/adv<i>']` [b], each term's step-wide normaliser into `info['composer/norm<i>']`, and into each
    label the self-teachers' prompt ids and row weights and each term's row mask (its gate, the rollout filter)."""
    from composer.backends.openrlhf.batch import encode_label
    from composer.stops import for_spec

    labels = [x for e in experiences for x in e.labels]
    batch = step_batch(experiences, tokenizer.pad_token_id)
    at = plan.at(plan.offset + step_of(labels))
    spec = at.spec
    advs = {}
    if batch.rewards is not None:
        advs = {t.index: a for t in at.terms for a in [the_step.advantages(t, batch)] if a is not None}
    metas = [decode_label(x) for x in labels]
    for name, info in plugin.get("teachers", {}).items():
        if not (info["self"] and info["context"]) or name not in spec.sources:
            continue
        for meta, (ids, w) in zip(metas, teacher_prompts(spec, name, batch, tokenizer, task)):
            meta.setdefault("teacher", {})[name] = ids
            meta.setdefault("teacher_weight", {})[name] = w  # only this teacher's terms read it
    # a row is finished when it ends in one of the policy's stop tokens (composer/stops.py), as the agent reported
    eos = plugin.get("eos_id", -1) if getattr(tokenizer, "eos_token_id", None) is None else \
        for_spec(tokenizer, at.spec, again=False).ids
    for i, rows in enumerate(the_step.row_masks(at, batch, eos)):
        if rows is not None:
            for meta, r in zip(metas, rows.tolist()):
                meta.setdefault("gate", {})[str(i)] = bool(r)
    loss_view = step_batch(experiences, tokenizer.pad_token_id, trainable_only=True, metas=metas)
    norms = the_step.normalisers(at, term_batches(at, loss_view, metas))
    start = 0
    for e in experiences:
        b = len(e.prompts)
        for i, a in advs.items():
            e.info[f"composer/adv{i}"] = a[start: start + b].detach().float().cpu()
        for i, n in norms.items():  # the step's normaliser of each term, per sample (OpenRLHF splits info by row)
            e.info[f"composer/norm{i}"] = torch.full((b,), n)
        e.labels = [encode_label(m) for m in metas[start: start + b]]
        start += b
