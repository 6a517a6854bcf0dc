"""Evaluation: greedy pass@1 of the current policy on each held-out tier, with no guide."""

from __future__ import annotations

import torch

from composer.runtime.engine import Sampling, hf_generate


@torch.no_grad()
def pass_at_1(ctx, policy, examples, max_new_tokens: int) -> float:
    if not examples:
        return float("nan")
    was_training = policy.training
    policy.eval()
    gens = hf_generate(policy, ctx.tokenizer, [ctx.encode(e.prompt) for e in examples], max_new_tokens,
                       Sampling(greedy=True))
    policy.train(was_training)
    verify = ctx.verifier("auto")
    return sum(verify(ctx.decode(g.tokens), e).reward for g, e in zip(gens, examples)) / len(examples)


def evaluate(ctx, policy) -> dict[str, float]:
    return {f"pass@1/{tier}": pass_at_1(ctx, policy, exs, ctx.max_new_tokens) for tier, exs in ctx.task.eval.items()}
