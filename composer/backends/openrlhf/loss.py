"""The composer's objectives inside OpenRLHF: step advantages, privileged-context teacher scores, the loss.

Everything here is torch over plain tensors (no OpenRLHF import), so it runs on CPU in the tests. The
formulas are the composer's own functions (components/objectives), never re-derived:
  - the advantage step sees the whole step's samples, so V-hat (`soft_value`) and GRPO's group
    statistics (`group_advantages`) are computed over full groups, as in the Lightning backend;
  - the training step sees a micro-batch: `ComposerLoss` rebuilds a TrajectoryBatch from the Experience
    and sums the terms (`sequence_log_ratio` + `regression_loss`, `clipped_surrogate` + `aggregate`,
    `Divergence.loss`, `CrossEntropy.loss`), scaled so that micro-batches and DP ranks add up to the
    step's mean over sequences (OpenRLHF's `global_batch_size` normaliser).
"""

from __future__ import annotations

import dataclasses

from components.objectives.advantage_regression import regression_loss, sequence_log_ratio, soft_value
from components.objectives.base import aggregate, group_advantages, masked_mean
from components.objectives.grpo import clipped_surrogate, kl_estimate
from composer.backends.openrlhf.batch import decode_label, shift, to_batch
from composer.batch import PolicyView, TrajectoryBatch
from composer.graph import signal_objective_pairs
from composer.lazy import F, torch
from composer.origins import CODE


def terms(spec) -> list[tuple[str, object, object, float]]:
    """(name, signal, objective, weight) of every term of a resolved spec (as composer.runtime.step.terms)."""
    if spec.terms:
        return [(t.name or f"term{i}", t.signal, t.objective, t.weight) for i, t in enumerate(spec.terms)]
    return [("term0", *signal_objective_pairs(spec)[0], 1.0)]


class Segments:
    """The resolved spec of each step range of a run (phases), from plan.json's segments."""

    def __init__(self, plan: dict, indices: list[int]):
        from composer import registry
        from composer.spec import spec_model

        registry.load_all()
        for module in plan["segments"][indices[0]]["spec"].get("plugins") or []:
            __import__(module)
        model = spec_model()
        self.items = [(plan["segments"][i]["start"], plan["segments"][i]["end"],
                       model.model_validate(plan["segments"][i]["spec"])) for i in indices]
        self.offset = self.items[0][0]  # a stage's steps count from its own start

    def at(self, step: int):
        """The spec in force at `step` (0-based within the run); the last one past the end."""
        step += self.offset
        for start, end, spec in self.items:
            if start <= step < end:
                return spec
        return self.items[-1][2]


def step_of(labels) -> int:
    """The trainer step a batch was sampled at (put into every label when prompts are dispatched)."""
    return int(decode_label(labels[0]).get("step", 0)) if len(labels) else 0


# --------------------------------------------------------------------------------------- advantages

def advantages(term_list, batch: TrajectoryBatch) -> dict[int, torch.Tensor]:
    """Per-row advantage [B] of every term that has one, over the whole step (full groups).

    advantage_regression: A = r - V_hat, V_hat = soft_value over the group's baseline rows;
    grpo: A = group_advantages (std-normalised or not). Other objectives read no advantage.
    """
    out = {}
    for i, (_name, _sig, obj, _w) in enumerate(term_list):
        kind = obj.kind_name()
        if kind == "advantage_regression":
            base = batch.control if obj.baseline == "control" else None
            v_hat, _ = soft_value(batch.rewards, batch.group, obj.beta1, base)
            out[i] = batch.rewards - v_hat
        elif kind == "grpo":
            out[i] = group_advantages(batch.rewards, batch.group, obj.std_norm, obj.std_eps)
    return out


# ------------------------------------------------------------------------------------ teacher scores

def prompt_lengths(batch_or_origin) -> list[int]:
    """P_i: tokens before the first response token of each row."""
    origin = batch_or_origin.origin if isinstance(batch_or_origin, TrajectoryBatch) else batch_or_origin
    resp = (origin != CODE["prompt"]) & (origin != CODE["pad"])
    first = torch.where(resp.any(1), resp.float().argmax(1), (origin != CODE["pad"]).sum(1))
    return first.tolist()


def context_scores(forward_logits, tokens, attention_mask, prompt_len: list[int], teacher_prompts: list,
                   temperature: float, pad_id: int, want_logits: bool):
    """Teacher log-probs (and logits) of each row's response under its privileged-context prompt.

    Row i of the teacher input is [teacher_prompts[i] (or the row's own prompt when None)][response_i];
    `forward_logits(ids [B, T2], mask [B, T2]) -> [B, T2, V]` gives raw next-token logits. Student
    position t maps to teacher position t + Q_i - P_i (Q_i, P_i: teacher / student prompt lengths), as in
    the Lightning teacher (components/sources/policy_model.py). Returns lp [B, T] and logits [B, T, V]
    or None, 0 off the response, logits divided by `temperature`.
    """
    B, T = tokens.shape
    n_tok = attention_mask.long().sum(1).tolist()
    seqs, q_len = [], []
    for i in range(B):
        row = tokens[i].tolist()
        prompt = list(teacher_prompts[i]) if teacher_prompts[i] is not None else row[: prompt_len[i]]
        seqs.append(prompt + row[prompt_len[i]: n_tok[i]])
        q_len.append(len(prompt))
    T2 = max(len(s) for s in seqs)
    ids = torch.full((B, T2), pad_id, dtype=torch.long, device=tokens.device)
    mask = torch.zeros((B, T2), dtype=torch.long, device=tokens.device)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s, device=tokens.device)
        mask[i, : len(s)] = 1
    with torch.no_grad():
        raw = forward_logits(ids, mask).float() / temperature  # [B, T2, V]: position j predicts j + 1
    logits2 = shift(raw[:, :-1])  # [B, T2, V]: position t predicts token t
    lp2 = F.log_softmax(logits2, -1).gather(-1, ids[..., None]).squeeze(-1)  # [B, T2]
    lp2[:, 0] = 0.0
    off = torch.tensor(q_len, device=tokens.device) - torch.tensor(prompt_len, device=tokens.device)  # [B]
    pos = (torch.arange(T, device=tokens.device)[None, :] + off[:, None]).clamp(0, T2 - 1)  # [B, T]
    resp = torch.zeros((B, T), dtype=torch.bool, device=tokens.device)
    for i in range(B):
        resp[i, prompt_len[i]: n_tok[i]] = True
    lp = lp2.gather(1, pos) * resp
    logits = None
    if want_logits:
        V = logits2.shape[-1]
        logits = logits2.gather(1, pos[..., None].expand(B, T, V)) * resp[..., None]
    return lp, logits


# ----------------------------------------------------------------------------------------- the loss

def term_loss(obj, batch: TrajectoryBatch, view: PolicyView, adv):
    """One term's loss on a micro-batch, with the step-level advantage `adv` [B] where the objective has one."""
    kind = obj.kind_name()
    if kind == "advantage_regression":
        mask = obj.loss_mask(batch)
        log_ratio = sequence_log_ratio(view.logprobs, obj.anchor_logprobs(batch), mask)  # [B]
        loss = regression_loss(log_ratio, adv, obj.beta2, batch.weights())
        return loss, {"loss": float(loss.detach()), "adv_mean": float(adv.float().mean()),
                      "logratio_mean": float(log_ratio.detach().float().mean())}
    if kind == "grpo":
        mask = obj.loss_mask(batch)
        lo = obj.clip if obj.clip_low is None else obj.clip_low
        hi = obj.clip if obj.clip_high is None else obj.clip_high
        surr, clipped, _ = clipped_surrogate(view.logprobs, batch.behavior_logprobs, adv.to(view.logprobs.dtype)[:, None],
                                             lo, hi)
        loss = aggregate(-surr, mask, obj.loss_agg, obj.norm_const)
        metrics = {"pg_loss": float(loss.detach()), "clip_frac": float(masked_mean(clipped.float(), mask))}
        if obj.kl_coef > 0:
            kl = aggregate(kl_estimate(view.logprobs - batch.initial_logprobs.detach(), obj.kl_estimator), mask,
                           obj.loss_agg, obj.norm_const)
            loss = loss + obj.kl_coef * kl
            metrics["kl"] = float(kl.detach())
        return loss, metrics
    return obj.loss(batch, view)


def total_loss(term_list, batches, view: PolicyView, advs: dict):
    """sum_k w_k L_k over the terms; `batches` holds one batch per term (teacher fields differ per term)."""
    total, metrics = 0.0, {}
    many = len(term_list) > 1
    for i, ((name, _sig, obj, weight), b) in enumerate(zip(term_list, batches)):
        value, m = term_loss(obj, b, view, advs.get(i))
        total = total + weight * value
        metrics.update({(f"{name}/{k}" if many else k): v for k, v in m.items()})
    return total, metrics


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
        out = []
        term_list = terms(spec)
        metas = [decode_label(x) for x in exp.labels]
        for _name, sig, _obj, _w in term_list:
            b = batch
            if sig.kind_name() == "distillation":
                t = self.ctx.get("teachers", {}).get(sig.teacher)
                if t is not None:  # a self-teacher scored in the training step
                    b = dataclasses.replace(batch, teacher_logprobs=t[0], teacher_logits=t[1])
                elif base is not None:  # an external teacher in the reference slot
                    b = dataclasses.replace(batch, teacher_logprobs=shift(base.float()))
                tw = [m.get("teacher_weight", {}).get(sig.teacher) for m in metas]
                if any(w is not None for w in tw):  # SDPO's s_i weighs this term only
                    s_i = torch.tensor([1.0 if w is None else float(w) for w in tw], device=batch.tokens.device)
                    b = dataclasses.replace(b, seq_weight=b.weights() * s_i)
            out.append(b)
        return term_list, out

    def __call__(self, log_probs, old_log_probs, advantages, action_mask=None, rollout_log_probs=None, dp_size=1,
                 batch_num_tokens=None, global_batch_size=None):
        exp = self.ctx["experience"]
        spec = self.segments.at(step_of(exp.labels))
        term_list, batches = self.batches(spec, log_probs, action_mask, rollout_log_probs)
        advs = {i: a.to(log_probs.device) for i, a in self.ctx.get("advantages", {}).items()}
        logits = self.ctx.get("logits")
        view = PolicyView(shift(log_probs), logits=None if logits is None else shift(logits[:, :-1]))
        loss, metrics = total_loss(term_list, batches, view, advs)
        rows = (action_mask.sum(-1) > 0).sum()
        if global_batch_size is not None:  # micro-batches and DP ranks add up to the step's mean
            loss = loss * rows / global_batch_size * dp_size
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


def step_batch(experiences, pad_id: int, trainable_only: bool = False) -> TrajectoryBatch:
    """One TrajectoryBatch over every sample of a step (all micro-batches of the experience maker), with
    the real advantage groups (prompt x guide tag)."""
    from composer.backends.openrlhf.batch import group_ids

    prompts = [p for e in experiences for p in e.prompts]
    labels = [x for e in experiences for x in e.labels]
    rlp = [e.rollout_log_probs for e in experiences]
    rewards = [e.rewards for e in experiences]
    return to_batch(_pad_cat([e.sequences for e in experiences], pad_id),
                    _pad_cat([e.attention_mask for e in experiences]), _pad_cat([e.action_mask for e in experiences]),
                    prompts, labels,
                    rollout_log_probs=None if any(x is None for x in rlp) else _pad_cat(rlp),
                    rewards=None if any(x is None for x in rewards) else torch.cat([r.reshape(-1) for r in rewards]),
                    group=group_ids(prompts, [decode_label(x) for x in labels]), trainable_only=trainable_only)


def teacher_prompts(spec, name: str, batch: TrajectoryBatch, tokenizer, task):
    """(prompt token ids or None, weight) per row for the self-teacher `name`: the Lightning teacher's own
    context rules and templates (components/sources/policy_model.py), over the whole step."""
    from components.sources.policy_model import Teacher
    from composer.runtime.context import RunContext

    ctx = RunContext(task=task, tokenizer=tokenizer, policy=None, engine=None, spec=spec)
    cfg = spec.sources[name]
    teacher = Teacher.__new__(Teacher)  # the prompt rules only: no weights are loaded here
    teacher.cfg, teacher.name, teacher.net = cfg, name, None
    teacher.sources = {c: ctx.source(c) for c in cfg.context}
    teacher.kinds = {c: spec.sources[c].kind for c in cfg.context}
    out = []
    for i in range(batch.size):
        text = teacher.prompt_text(ctx, batch.examples[i], teacher.context_texts(ctx, batch, i))
        out.append((None, 0.0) if text is None else (tokenizer.encode(text, add_special_tokens=False), 1.0))
    return out


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
    start = 0
    for e in experiences:
        b = len(e.prompts)
        for i, a in advs.items():
            e.info[f"composer/adv{i}"] = a[start: start + b].detach().float().cpu()
        e.labels = [encode_label(m) for m in metas[start: start + b]]
        start += b
