"""The composer's objectives inside OpenRLHF: step advantages, privileged-context teacher scores, the loss.

Everything here is torch over plain tensors (no OpenRLHF import), so it runs on CPU in the tests. Every
formula is the component's own (DESIGN.md section 8), never re-derived and never chosen by kind:
  - the advantage step sees the whole step's samples, so each objective's `advantages(batch)` runs over
    full groups, as in the Lightning backend (an objective computes them once per rollout, before the
    micro-batches: a plugin objective with its own advantages works the same on both backends);
  - the training step sees a micro-batch: `ComposerLoss` rebuilds a TrajectoryBatch from the Experience
    and sums the terms' `loss(batch, view, advantages)`, scaled so that micro-batches and DP ranks add up
    to the step's mean over sequences (OpenRLHF's `global_batch_size` normaliser);
  - teachers score with `score_responses` (components/sources/policy_model.py), prompts from the
    source's own context rules (`teacher_prompts`).
"""

from __future__ import annotations

import dataclasses

from components.objectives.base import masked_mean
from composer.backends.openrlhf.batch import decode_label, shift, to_batch
from composer.batch import PolicyView, TrajectoryBatch
from composer.lazy import F, torch
from composer.origins import CODE
from composer.gates import row_surprisal
from composer.checks.terms import gates, terms, terms_at  # noqa: F401  (hooks and agent read terms here)


class Segments:
    """The resolved spec of each step range of one OpenRLHF run (its plan segments); steps in labels count
    from the run's start, which is the first segment's global start."""

    def __init__(self, plan: dict, indices: list[int]):
        from composer.plan.segments import segments_of

        self.items = segments_of(plan, indices)
        self.offset = self.items[0].start

    def segment(self, step: int):
        """The segment in force at run step `step` (the last one past the end)."""
        from composer.plan.segments import segment_at

        return segment_at(self.items, step + self.offset)

    def at(self, step: int):
        return self.segment(step).spec


def step_of(labels) -> int:
    """The trainer step a batch was sampled at (put into every label when prompts are dispatched)."""
    return int(decode_label(labels[0]).get("step", 0)) if len(labels) else 0


# --------------------------------------------------------------------------------------- advantages

def advantages(term_list, batch: TrajectoryBatch) -> dict[int, torch.Tensor]:
    """Per-row advantage [B] of every term whose objective has one, over the whole step (full groups)."""
    out = {}
    for i, (_name, _sig, obj, _w) in enumerate(term_list):
        adv = obj.advantages(batch)
        if adv is not None:
            out[i] = adv.detach()
    return out


# ------------------------------------------------------------------------------------ teacher scores

def prompt_lengths(batch_or_origin) -> list[int]:
    """P_i: tokens before the first response token of each row."""
    origin = batch_or_origin.origin if isinstance(batch_or_origin, TrajectoryBatch) else batch_or_origin
    resp = (origin != CODE["prompt"]) & (origin != CODE["pad"])
    first = torch.where(resp.any(1), resp.float().argmax(1), (origin != CODE["pad"]).sum(1))
    return first.tolist()


# ----------------------------------------------------------------------------------------- the loss

def total_loss(term_list, batches, view: PolicyView, advs: dict, scale: dict | None = None):
    """sum_k w_k c_k L_k over the terms; `batches` holds one batch per term (teacher fields differ per term),
    c_k (`scale`, default 1) is the micro-batch's share of term k's normaliser over the step."""
    total, metrics = 0.0, {}
    many = len(term_list) > 1
    for i, ((name, _sig, obj, weight), b) in enumerate(zip(term_list, batches)):
        value, m = obj.loss(b, view, advs.get(i))
        total = total + weight * (scale or {}).get(i, 1.0) * value
        metrics.update({(f"{name}/{k}" if many else k): v for k, v in m.items()})
    return total, metrics


def micro_scale(obj, micro: TrajectoryBatch, step_norm: float, dp_size: int = 1, gas: int = 1):
    """c_k of a micro-batch: its share of the objective's step-wide normaliser, times the DP ranks (DeepSpeed
    averages gradients over them) and the accumulation steps (DeepSpeed divides each backward by gas)."""
    return obj.normalizer(micro) / max(float(step_norm), 1e-12) * dp_size * gas


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


def term_batches(term_list, batch: TrajectoryBatch, metas: list[dict]) -> list[TrajectoryBatch]:
    """One view of `batch` per term: a teacher term's rows weighted by its teacher's s_i (SDPO's rows with
    no signal), which only that teacher's terms read (labels carry `teacher_weight` per teacher)."""
    out = []
    for _name, sig, _obj, _w in term_list:
        b = batch
        name = sig.teacher_source
        tw = [m.get("teacher_weight", {}).get(name) for m in metas] if name is not None else []
        if any(w is not None for w in tw):
            s_i = torch.tensor([1.0 if w is None else float(w) for w in tw], device=batch.tokens.device)
            b = dataclasses.replace(batch, seq_weight=batch.weights() * s_i)
        gate = [m.get("gate", {}).get(str(len(out))) for m in metas]  # the advantage step's gate_rows
        if any(g is not None for g in gate):
            b = dataclasses.replace(b, row_mask=torch.tensor([g is not False for g in gate], device=batch.tokens.device))
        out.append(b)
    return out


class ComposerLoss:
    """Drop-in for OpenRLHF's PolicyLoss (same call and return values); the training-step patch puts the
    current Experience (and the student's / teachers' logits when wanted) into `self.ctx` first."""

    def __init__(self, segments: Segments, plugin: dict):
        self.segments, self.plugin = segments, plugin
        self.ctx: dict = {}

    def batches(self, spec, log_probs, action_mask, rollout_log_probs):
        """(terms, one TrajectoryBatch per term) for the Experience in ctx."""
        exp = self.ctx["experience"]
        base = exp.base_action_log_probs
        batch = to_batch(exp.sequences, exp.attention_mask, action_mask, exp.prompts, exp.labels,
                         rollout_log_probs=rollout_log_probs, rewards=exp.rewards, trainable_only=True)
        if base is not None and self.plugin.get("ref") == "initial":
            batch.initial_logprobs = shift(base.float())
        term_list = terms(spec)
        out = term_batches(term_list, batch, [decode_label(x) for x in exp.labels])
        for k, ((_name, sig, _obj, _w), b) in enumerate(zip(term_list, out)):
            name = sig.teacher_source
            if name is None:
                continue
            t = self.ctx.get("teachers", {}).get(name)
            if t is not None:  # a self-teacher scored in the training step
                out[k] = dataclasses.replace(b, teacher_logprobs=t[0], teacher_logits=t[1])
            elif base is not None:  # an external teacher in the reference slot
                out[k] = dataclasses.replace(b, teacher_logprobs=shift(base.float()))
        return term_list, out

    def __call__(self, log_probs, old_log_probs, advantages, action_mask=None, rollout_log_probs=None, dp_size=1,
                 batch_num_tokens=None, global_batch_size=None):
        exp = self.ctx["experience"]
        spec = self.segments.at(step_of(exp.labels))
        _, batches = self.batches(spec, log_probs, action_mask, rollout_log_probs)
        if spec.train.epochs > 1:  # several passes (--train.max_epochs): the ratio's denominator is the actor's
            old = shift(old_log_probs.float())  # log-prob of the make-experience step, before the first pass
            batches = [dataclasses.replace(b, old_logprobs=old) for b in batches]
        # scheduled numbers (term weights, kl_coef) at the step's global index, as on Lightning
        term_list = terms_at(spec, self.segments.offset + step_of(exp.labels))
        advs = {i: a.to(log_probs.device) for i, a in self.ctx.get("advantages", {}).items()}
        logits = self.ctx.get("logits")
        view = PolicyView(shift(log_probs), logits=None if logits is None else shift(logits[:, :-1]))
        norms = self.ctx.get("norms", {})
        # DeepSpeed scales every micro-batch's backward by 1 / gas (gradient accumulation steps): x gas undoes it
        gas = self.ctx.get("gas", 1)
        if norms:  # each term's micro-batch share of the step's normaliser: micro-batches and DP ranks add up
            scale = {i: micro_scale(obj, b, norms[i], dp_size, gas)
                     for i, ((_n, _s, obj, _w), b) in enumerate(zip(term_list, batches)) if i in norms}
        else:  # no advantage step ran (it records the normalisers): a mean over the step's sequences
            rows = (action_mask.sum(-1) > 0).sum()
            share = rows / global_batch_size * dp_size if global_batch_size is not None else 1.0
            scale = {i: share for i in range(len(term_list))}
        loss, metrics = total_loss(term_list, batches, view, advs, scale)
        from composer.gates import gate_metrics

        for (name, _s, _o, _w), b in zip(term_list, batches):  # the gate's share of this micro-batch's rows
            if b.row_mask is not None:
                metrics.update(gate_metrics(name, b.row_mask, len(term_list) > 1))
        for k, v in metrics.items():
            exp.info[f"composer/{k}"] = torch.tensor(float(v))
        if not getattr(loss, "requires_grad", False):  # no loss token in this micro-batch: a zero with a graph
            loss = loss + 0.0 * log_probs.sum()
        ppo_kl = masked_mean((old_log_probs - log_probs).detach(), action_mask.bool())
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
    """(prompt token ids or None, weight) per row for the self-teacher `name`: the source's own context rules
    and templates (components/sources/policy_model.py `teacher_prompts`), over the whole step."""
    from components.sources.policy_model import teacher_prompts as prompts_of
    from composer.runtime.context import RunContext

    ctx = RunContext(task=task, tokenizer=tokenizer, policy=None, engine=None, spec=spec)
    cfg = spec.sources[name]
    return prompts_of(ctx, cfg, {c: spec.sources[c].kind for c in cfg.context}, name, batch)


def gate_step(spec, batch: TrajectoryBatch, metas: list[dict], plugin: dict, tokenizer=None) -> None:
    """Each gated term's rows over the whole step (composer/gates.py, as Lightning's step computes them) into
    the labels: meta['gate'][term] per row; success is the sample's reward (from the run's one reward
    source, which compile checked is the gate's) against that source's success_threshold."""
    from composer.gates import gate_rows

    if plugin.get("mask_truncated"):  # rollout.filter.truncated: mask, for every term (composer/filters.py)
        from composer.filters import truncated_rows

        cut = truncated_rows(batch, plugin.get("eos_id", -1) if tokenizer is None else tokenizer.eos_token_id)
        for i in range(len(gates(spec))):
            for meta, c in zip(metas, cut.tolist()):
                meta.setdefault("gate", {})[str(i)] = not c
    for i, gate in enumerate(gates(spec)):
        if gate is None:
            continue
        if batch.rewards is None:
            raise ValueError("a term gate needs the samples' rewards, and this step has none")
        src = spec.sources[plugin.get("reward_source")]
        success = batch.rewards >= src.success_threshold  # [B]
        surprisal = None
        if gate.entropy_above_quantile is not None or gate.entropy_below_quantile is not None:
            surprisal = row_surprisal(batch.behavior_logprobs, batch.policy_mask & batch.known_mask)
        rows = gate_rows(gate, success, batch.group, surprisal)  # [B]
        for meta, r in zip(metas, rows.tolist()):
            meta.setdefault("gate", {})[str(i)] = bool(r) and meta.get("gate", {}).get(str(i), True)


def prepare_step(experiences, segments: Segments, plugin: dict, tokenizer, task) -> None:
    """The advantage step over the whole step's experiences (in place): per-term advantages into
    `info['composer/adv<i>']` [b], and for self-teachers with a context the teacher prompt ids and the
    row weight into each label."""
    from composer.backends.openrlhf.batch import encode_label

    labels = [x for e in experiences for x in e.labels]
    batch = step_batch(experiences, tokenizer.pad_token_id)
    spec = segments.at(step_of(labels))
    advs = advantages(terms(spec), batch) if batch.rewards is not None else {}
    metas = [decode_label(x) for x in labels]
    for name, info in plugin.get("teachers", {}).items():
        if not (info["self"] and info["context"]) or name not in spec.sources:
            continue
        for meta, (ids, w) in zip(metas, teacher_prompts(spec, name, batch, tokenizer, task)):
            meta.setdefault("teacher", {})[name] = ids
            meta.setdefault("teacher_weight", {})[name] = w  # only this teacher's terms read it
    term_list = terms(spec)
    gate_step(spec, batch, metas, plugin, tokenizer)
    loss_view = step_batch(experiences, tokenizer.pad_token_id, trainable_only=True, metas=metas)
    norms = {i: float(obj.normalizer(b)) for i, ((_n, _s, obj, _w), b)
             in enumerate(zip(term_list, term_batches(term_list, loss_view, metas))) if obj is not None}
    start = 0
    for e in experiences:
        b = len(e.prompts)
        for i, a in advs.items():
            e.info[f"composer/adv{i}"] = a[start: start + b].detach().float().cpu()
        for i, n in norms.items():  # the step's normaliser of each term, per sample (OpenRLHF splits info by row)
            e.info[f"composer/norm{i}"] = torch.full((b,), n)
        e.labels = [encode_label(m) for m in metas[start: start + b]]
        start += b
