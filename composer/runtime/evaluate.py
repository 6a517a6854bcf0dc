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


def unbiased_pass_at_k(n: int, c: int, k: int) -> float:
    """Chen et al. 2021: 1 - C(n-c, k) / C(n, k), the chance that k of n samples include a correct one."""
    if n - c < k:
        return 1.0
    prob = 1.0
    for i in range(n - c + 1, n + 1):
        prob *= 1.0 - k / i
    return 1.0 - prob


@torch.no_grad()
def pass_at_k(ctx, policy, examples, n: int = 32, ks=(1, 2, 4, 8, 16, 32), temperature: float = 1.0) -> dict[int, float]:
    """Unbiased pass@k from n samples per problem at `temperature` (no guide)."""
    was_training = policy.training
    policy.eval()
    prompts = [ctx.encode(e.prompt) for e in examples for _ in range(n)]
    gens = hf_generate(policy, ctx.tokenizer, prompts, ctx.max_new_tokens, Sampling(temperature=temperature))
    policy.train(was_training)
    verify = ctx.verifier("auto")
    out = {k: 0.0 for k in ks if k <= n}
    for i, e in enumerate(examples):
        c = sum(verify(ctx.decode(g.tokens), e).reward >= 1.0 for g in gens[i * n:(i + 1) * n])
        for k in out:
            out[k] += unbiased_pass_at_k(n, c, k) / len(examples)
    return out
