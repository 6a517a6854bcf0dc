"""One training step, composed from the registry: rollout -> signals -> advantages -> objectives.

No method names here: every component does its part through the contract (composer/contract.py,
components/objectives/base.py), as it does on the OpenRLHF backend.
"""

from __future__ import annotations

import torch

from composer.batch import PolicyView, TrajectoryBatch, concat
from components.objectives.base import zero_advantage_fraction
from composer.runtime.context import RunContext
from composer.runtime.models import token_logprobs
from composer.lang.curves import is_scheduled, value_at
from composer.checks.terms import gates, rolls_out, terms, terms_at  # noqa: F401  (re-exported: components read terms through step)


def collect(ctx: RunContext, examples) -> list[TrajectoryBatch]:
    """The step's batches. With `sync.reuse`, the rollouts sampled right after a sync are stored and
    trained on at every step until the next sync; `clear_buffer: false` keeps older ones too."""
    sync = ctx.spec.sync
    if not sync.reuse:
        return sample(ctx, examples)
    version = ctx.engine.last_sync
    if ctx.state.buffer and ctx.state.buffer_version == version:
        ctx.log(buffer_reused=1.0)
        return ctx.state.buffer
    fresh = sample(ctx, examples)
    if ctx.state.buffer and not sync.clear_buffer:
        fresh = [concat([old, new], ctx.pad_id) for old, new in zip(ctx.state.buffer, fresh)]
    ctx.state.buffer, ctx.state.buffer_version = fresh, version
    ctx.log(buffer_reused=0.0, buffer_rows=float(fresh[0].size))
    return fresh


def sample(ctx: RunContext, examples) -> list[TrajectoryBatch]:
    """Build one batch per term: one shared rollout for every term that needs rollouts; each term's signal
    fills its own view of it. Advantages are computed here, over the whole step's groups."""
    rollout: TrajectoryBatch | None = None
    if ctx.spec.rollout.filter.active and rolls_out(ctx.spec):  # filters run before any term reads the rollout
        from composer.filters import filtered_rollout

        rollout, examples = filtered_rollout(ctx, examples, ctx.spec.rollout.samples_per_prompt)
    out = []
    names = [n for n, _s, _o, _w in terms(ctx.spec)]
    by_term: dict[str, dict] = {}  # what each term's signal logged: per term when several terms log a key
    for name, sig, obj, _w in terms(ctx.spec):
        if sig.makes_batch:
            batch = sig.make_batch(ctx, examples)
        else:
            if rollout is None:
                rollout = ctx.spec.rollout.guide.rollout(ctx, examples, ctx.spec.rollout.samples_per_prompt)
            batch = rollout.term_view()
        step_metrics, ctx.metrics = ctx.metrics, {}
        try:
            batch = sig.apply(ctx, batch)
        finally:
            by_term[name], ctx.metrics = ctx.metrics, step_metrics
        ctx.metrics.update(by_term[name])
        if obj.wants_initial and batch.initial_logprobs is None:
            shared = rollout is not None and batch.tokens is rollout.tokens  # computed once per rollout
            owner = rollout if shared else batch
            if owner.initial_logprobs is None:
                owner.initial_logprobs = initial_logprobs(ctx, owner)
            batch.initial_logprobs = owner.initial_logprobs
        adv = obj.advantages(batch)
        batch.advantages = None if adv is None else adv.detach()
        out.append(batch)
    if len(names) > 1:  # e.g. two distillation terms' teacher_kl_estimate: each under its term's name
        for name, logged in by_term.items():
            ctx.metrics.update({f"{name}/{k}": v for k, v in logged.items()})
        for k in {k for logged in by_term.values() for k in logged}:
            if sum(k in logged for logged in by_term.values()) > 1:
                ctx.metrics.pop(k, None)  # no single value would be right
    apply_gates(ctx, out, rollout)
    return out


def apply_gates(ctx: RunContext, batches: list[TrajectoryBatch], rollout: TrajectoryBatch | None) -> None:
    """Each gated term's rows (composer/gates.py) as its batch's row_mask, from the step's rollout: success by
    the gate's outcome_reward source, groups, surprisal of the behaviour log-probs. Logs each gate's fraction."""
    from composer.gates import gate_by_prompt, gate_metrics, gate_rows, gate_source, row_surprisal

    gated = [(i, g) for i, g in enumerate(gates(ctx.spec)) if g is not None]
    if not gated:
        return
    names = [n for n, _s, _o, _w in terms(ctx.spec)]
    success = {}
    for i, gate in gated:
        b = batches[i]
        src = gate_source(gate, ctx.spec)
        if src not in success:
            success[src] = torch.tensor(ctx.source(src).success(ctx, rollout), dtype=torch.bool)
        ok = success[src]
        if b.tokens is rollout.tokens:  # a view of the rollout: its own rows
            surprisal = row_surprisal(rollout.behavior_logprobs, rollout.policy_mask & rollout.known_mask) \
                if gate.entropy_above_quantile is not None or gate.entropy_below_quantile is not None else None
            rows = gate_rows(gate, ok, rollout.group, surprisal)
            b.row_mask = rows if b.row_mask is None else rows & b.row_mask  # a filter may have masked rows
        else:  # a batch the signal built (SFT on references): its prompt's rollouts decide
            if gate.row_facts():
                raise ValueError(f"term {names[i]}: its gate tests {', '.join(gate.row_facts())} of rollout rows, and "
                                 "its signal trains on rows it built (validation refuses this)")
            b.row_mask = gate_by_prompt(gate, ok, rollout.prompt_index, b.prompt_index)
        ctx.log(**gate_metrics(names[i], b.row_mask, len(names) > 1))


@torch.no_grad()
def initial_logprobs(ctx: RunContext, batch: TrajectoryBatch) -> torch.Tensor:
    """Log-probs of the batch under the frozen reference policy (KL losses, A*PO's anchor)."""
    model = ctx.forward_model(ctx.initial_policy())
    device = next(model.parameters()).device
    lp, _, _ = token_logprobs(model, batch.tokens.to(device), batch.attention_mask.to(device),
                              batch.info.get("temperature", 1.0), prefix_len=batch.prompt_len.to(device))
    return lp.to(batch.tokens.device)


def policy_view(policy, batch: TrajectoryBatch, want_logits: bool, read=None) -> PolicyView:
    """The policy's log-probs, entropies (and logits if wanted) of the batch's tokens; with `read` [B, T] bool,
    promised at those positions only (`token_logprobs`)."""
    lp, logits, ent = token_logprobs(policy, batch.tokens, batch.attention_mask, batch.info.get("temperature", 1.0),
                                     want_logits, prefix_len=batch.prompt_len, read=read)
    return PolicyView(lp, logits, ent)


def read_masks(ctx: RunContext, batches: list[TrajectoryBatch]) -> dict[int, torch.Tensor]:
    """Per distinct rollout (id of its tokens): the positions any term's loss reads (`Objective.read_mask`),
    and the first batch's response tokens, whose entropy `loss` logs and may add as a bonus."""
    out: dict[int, torch.Tensor] = {}
    for (_n, _s, obj, _w), b in zip(terms(ctx.spec), batches):
        m = obj.read_mask(b)
        out[id(b.tokens)] = m if id(b.tokens) not in out else out[id(b.tokens)] | m
    first = batches[0]
    out[id(first.tokens)] = out[id(first.tokens)] | (first.response_mask & first.attention_mask)
    return out


def loss(ctx: RunContext, policy, batches: list[TrajectoryBatch], shares: dict | None = None) -> tuple[torch.Tensor, dict]:
    """Weighted sum of every term's objective, plus the entropy bonus; metrics per term. `shares[k]` scales
    term k's loss (a rank's share of the step-wide normaliser under DDP; 1 by default)."""
    views: dict[int, PolicyView] = {}  # one policy forward per rollout: terms' views share its tokens
    wants = {}
    for (_n, _s, obj, _w), b in zip(terms(ctx.spec), batches):
        wants[id(b.tokens)] = wants.get(id(b.tokens), False) or obj.wants_logits
    total = 0.0
    metrics: dict[str, float] = {}
    many = len(batches) > 1
    raw = [w for *_, w in terms(ctx.spec)]
    read = read_masks(ctx, batches)
    for i, ((name, _sig, obj, weight), b) in enumerate(zip(terms_at(ctx.spec, ctx.step), batches)):
        if id(b.tokens) not in views:
            views[id(b.tokens)] = policy_view(policy, b, wants[id(b.tokens)], read[id(b.tokens)])
        value, m = obj.loss(b, views[id(b.tokens)], b.advantages)
        m = {**obj.advantage_metrics(b), **m}
        ctx.record("term_loss", term=name, objective=obj, batch=b, view=views[id(b.tokens)], loss=value, weight=weight,
                   policy=policy)
        total = total + weight * (shares or {}).get(i, 1.0) * value
        for k, v in m.items():
            metrics[f"{name}/{k}" if many else k] = v
        if many:
            metrics[f"{name}/loss"] = float(value.detach())
        if is_scheduled(raw[i]):  # a scheduled weight: its value at this step
            metrics[f"{name}/weight" if many else "weight"] = float(weight)
    # entropy of the policy on the response tokens of the first rollout batch
    first = batches[0]
    view = views[id(first.tokens)]
    mask = first.response_mask & first.attention_mask
    ent = (view.entropy * mask).sum() / mask.sum().clamp(min=1)
    entropy_coef = value_at(ctx.spec.train.entropy_coef, ctx.step)
    if is_scheduled(ctx.spec.train.entropy_coef):
        metrics["entropy_coef"] = float(entropy_coef)
    if entropy_coef:
        total = total - entropy_coef * ent
    if mask.any():  # a batch with no response tokens (e.g. no SFT targets this step) has no entropy
        metrics["entropy"] = float(ent.detach())
    metrics.update(batch_metrics(next((b for b in batches if b.rewards is not None), first)))
    metrics.update(source_rewards(ctx, batches))
    return total, metrics


def source_rewards(ctx: RunContext, batches: list[TrajectoryBatch]) -> dict[str, float]:
    """`source_reward/<source>`: the mean reward of each reward source the step's terms read (one per source, even
    when several terms read it), beside `reward_mean` (the first one's)."""
    out = {}
    for (_name, sig, _obj, _w), b in zip(terms(ctx.spec), batches):
        source = getattr(sig, "source", None)
        if isinstance(source, str) and b.rewards is not None and f"source_reward/{source}" not in out:
            out[f"source_reward/{source}"] = float(b.rewards.float().mean())
    return out


def mini_batches(batches: list[TrajectoryBatch], n: int) -> list[list[TrajectoryBatch]]:
    """The step's batches (one per term) split into `n` mini-batches of whole groups, in group order: [n][terms].
    Terms that share a rollout are split the same way and keep sharing its tokens (one forward per rollout)."""
    if n == 1:
        return [batches]
    from dataclasses import replace

    out: list[list[TrajectoryBatch]] = [[] for _ in range(n)]
    split: dict[int, tuple[list, list]] = {}
    for b in batches:
        if id(b.tokens) not in split:
            ids = torch.unique(b.group)  # sorted group ids
            if ids.numel() < n:
                raise ValueError(f"train.mini_batches is {n}, but this step's batch holds {ids.numel()} groups: "
                                 "mini-batches hold whole groups; use fewer mini-batches or more prompts per step")
            rows = [torch.nonzero(torch.isin(b.group, part)).flatten() for part in torch.tensor_split(ids, n)]
            split[id(b.tokens)] = (rows, [b.select(r) for r in rows])
            parts = split[id(b.tokens)][1]
        else:
            rows, first = split[id(b.tokens)]
            parts = [replace(b.select(r), tokens=f.tokens, origin=f.origin) for r, f in zip(rows, first)]
        for j, part in enumerate(parts):
            out[j].append(part)
    return out


def batch_metrics(batch: TrajectoryBatch) -> dict[str, float]:
    """Per-step facts about the data: reward, length, off-policy tokens, groups with no signal."""
    out = {}
    resp = batch.response_mask
    n_resp = resp.sum().clamp(min=1)
    out["response_len"] = float(resp.sum(1).float().mean())
    out["response_tokens"] = float(resp.sum())  # so that shares over many steps can be weighted by tokens
    off = batch.mask(("guide_prefix", "guide_intervention", "demonstration")) & resp
    out["offpolicy_token_frac"] = float(off.sum() / n_resp)
    if batch.rewards is not None:
        r = batch.rewards
        out["reward_mean"] = float(r.mean())
        out["zero_advantage_frac"] = float(zero_advantage_fraction(r, batch.group))
        if batch.advantages is not None:
            out["adv_abs_mean"] = float(batch.advantages.abs().float().mean())
        if batch.guided is not None and batch.guided.any() and (~batch.guided).any():
            out["reward_guided"] = float(r[batch.guided].mean())
            out["reward_control"] = float(r[~batch.guided].mean())
    return out
