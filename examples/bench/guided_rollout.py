"""Cost of guided rollouts: MInTRL chunk reviews with the oracle judge against plain sampling.

    .venv/bin/python examples/bench/guided_rollout.py                 # specs/mintrl.yaml, toy testbed
    .venv/bin/python examples/bench/guided_rollout.py --prompts 8 --repeats 7 rollout.guide.chunk_tokens=24

Both sides sample the same prompts with the same engine and score their rollouts (behaviour
log-probs). The figure is wall time per generated policy token (discarded tokens included),
guided over plain: the target is <= 1.3x. Repeats are interleaved; medians are reported.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--spec", default="specs/mintrl.yaml")
    ap.add_argument("--prompts", type=int, default=4, help="prompts per rollout batch (the spec's samples_per_prompt each)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("overrides", nargs="*", help="spec overrides, e.g. policy.model=/path/to/student")
    args = ap.parse_args(argv)

    import torch

    from components.guides.none import NoGuide
    from composer.runtime.binding import bind_task
    from composer.runtime.context import RunContext
    from composer.runtime.engine import HFEngine
    from composer.runtime.models import load_model, load_tokenizer
    from composer.checks.validate import validate_file

    torch.set_num_threads(args.threads)
    spec = validate_file(args.spec, args.overrides).segments[0].spec
    task = bind_task(spec)
    tok = load_tokenizer(spec.policy.tokenizer or spec.policy.model or "toy:student")
    policy = load_model(spec.policy.model or "toy:student")
    ctx = RunContext(task=task, tokenizer=tok, policy=policy, engine=HFEngine(policy, tok), spec=spec,
                     rng=random.Random(0))
    guide, n = spec.rollout.guide, spec.rollout.samples_per_prompt
    sample_plain = NoGuide().rollout  # the same driver without a guide

    def timed(fn, examples):
        torch.manual_seed(0)
        before = ctx.costs["policy_tokens"]
        t0 = time.perf_counter()
        fn(ctx, examples, n)
        return time.perf_counter() - t0, ctx.costs["policy_tokens"] - before

    timed(sample_plain, ctx.next_prompts(args.prompts))  # warm-up
    plain, guided, revise = [], [], []
    for _ in range(args.repeats):
        examples = ctx.next_prompts(args.prompts)
        tp, np_ = timed(sample_plain, examples)
        tg, ng = timed(guide.rollout, examples)
        plain.append((tp, np_))
        guided.append((tg, ng))
        revise.append(ctx.metrics.get("guide/revise_rate", 0.0))
    per_tok = lambda xs: statistics.median(t / max(k, 1) for t, k in xs)  # noqa: E731
    ratio = statistics.median(g[0] / max(g[1], 1) / (p[0] / max(p[1], 1)) for p, g in zip(plain, guided))
    judge = spec.sources[guide.judge].kind if hasattr(guide, "judge") else "-"
    print(f"spec {args.spec}: {args.prompts} prompts x {n} samples, guide '{guide.kind}', judge '{judge}', {args.repeats} repeats")
    print(f"plain : {statistics.median(t for t, _ in plain):.3f} s, {statistics.median(k for _, k in plain):.0f} tokens, "
          f"{1e3 * per_tok(plain):.3f} ms/token")
    print(f"guided: {statistics.median(t for t, _ in guided):.3f} s, {statistics.median(k for _, k in guided):.0f} tokens, "
          f"{1e3 * per_tok(guided):.3f} ms/token, revise rate {statistics.median(revise):.2f}")
    print(f"guided / plain wall time per generated token: {ratio:.2f}x (target <= 1.3x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
