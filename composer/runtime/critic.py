"""Critics in the Lightning step: the old values before the advantages, the value updates next to the policy's.

An objective with a value model (`Objective.value_model()`, PPO's critic) gets, per term:
  critic_values   batch.values [B, T]: the critic's values of the step's rollout at its weights before the step
                  (no gradient), filled before `advantages` (which turn them into GAE advantages and returns);
  train_critics   an own network: train.epochs x train.mini_batches AdamW updates on `critic_loss`, over the same
                  mini-batches of whole groups as the policy's updates (OpenRLHF trains its critic on the replay
                  buffer of the step with the same epochs and batch size);
  with_critic_values  a head on the policy's network: its values with gradient, in the policy view of the loss;
  step_heads      that head's optimizer step, after every policy backward.
The critic's runtime (weights, AdamW state, update count) lives in ctx.state.runtimes and is checkpointed with
them; it is carried across phases, and across stages under train.critic_at_stage: keep (`RunContext.critic`), and
dropped at a stage's start under reset (`RunContext.reset_critics`). A segment with train.freeze_policy runs
`train_critics` alone (the Lightning module skips the policy's loss and optimizer step). Nothing here names a method:
it reads the objective's contract and the critic's runtime.
"""

from __future__ import annotations

import torch

from composer.batch import TrajectoryBatch


def _critic_terms(ctx):
    from composer.checks.terms import terms

    return [(i, name, obj) for i, (name, _s, obj, _w) in enumerate(terms(ctx.spec))
            if obj is not None and obj.value_model() is not None]


def critic_values(ctx, name: str, obj, batch: TrajectoryBatch) -> torch.Tensor:
    """[B, T] the values of term `name`'s critic on `batch` before the step's update (no gradient), recorded."""
    rt = ctx.critic(name, obj.value_model())
    values = rt.values(ctx, batch).detach()
    ctx.record("critic_values", term=name, batch=batch, critic=rt, values=values)
    return values


def _share(ctx, obj, b: TrajectoryBatch) -> float:
    """This rank's share of the step-wide value-loss normaliser times the number of ranks (1 with one process):
    the ranks' gradients, averaged, are those of the whole step's value loss."""
    world = ctx.data.world
    if world <= 1:
        return 1.0
    local = obj.critic_normalizer(b).detach().float().reshape(1)
    total = local.clone()
    torch.distributed.all_reduce(total)
    return float(local) * world / max(float(total), 1e-12)


def train_critics(ctx, batches: list[TrajectoryBatch]) -> dict[str, float]:
    """The step's value updates of every critic with its own network: train.epochs x train.mini_batches AdamW steps
    on its value loss, mini-batch k the policy's (run_step.mini_batches). Returns the last update's metrics (and the
    first's loss as critic/first_loss), per term when several terms have critics."""
    from composer.step import mini_batches

    todo = [(i, name, obj) for i, name, obj in _critic_terms(ctx) if obj.value_model().separate]
    if not todo:
        return {}
    t = ctx.spec.train
    parts = mini_batches(batches, t.mini_batches)
    n = t.epochs * t.mini_batches
    out: dict[str, float] = {}
    for i, name, obj in todo:
        rt = ctx.critic(name, obj.value_model())
        metrics: dict[str, float] = {}
        for k in range(n):
            b = parts[k % len(parts)][i]
            values = rt.values(ctx, b, grad=True)  # [B, T]
            loss, metrics = obj.critic_loss(b, values)
            ctx.record("critic_update", term=name, batch=b, values=values, loss=loss, critic=rt, update=k)
            (loss * _share(ctx, obj, b)).backward()
            if k == 0:
                first = float(loss.detach())
            ctx.record("critic_grads", term=name, critic=rt, update=k)  # the gradient the step reads, unclipped
            metrics.update(rt.step(ctx))
            ctx.record("critic_stepped", term=name, critic=rt, update=k)  # its weights after the step
        metrics["critic/first_loss"] = first
        prefix = f"{name}/" if len(todo) > 1 else ""
        out.update({prefix + key: v for key, v in metrics.items()})
    return out


def with_critic_values(ctx, name: str, obj, policy, batch: TrajectoryBatch, view):
    """The policy view of term `name`, with the values of its critic head on the policy's network (with gradient)
    when it has one; else `view` itself."""
    from dataclasses import replace

    cfg = obj.value_model()
    if cfg is None or cfg.separate:  # an own network is not read by the policy's loss
        return view
    rt = ctx.critic(name, cfg)
    values = rt.values(ctx, batch, grad=True, policy=policy)
    ctx.record("critic_head", term=name, batch=batch, values=values, critic=rt, policy=policy)
    return replace(view, values=values)


def step_heads(ctx) -> None:
    """After a policy backward: the optimizer step of every critic head on the policy's network."""
    if ctx is None or ctx.spec is None:
        return
    for _i, name, obj in _critic_terms(ctx):
        if not obj.value_model().separate:
            ctx.log(**ctx.critic(name, obj.value_model()).step(ctx))
