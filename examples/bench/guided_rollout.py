"""Cost of guided rollouts: MInTRL chunk reviews with the oracle judge against plain sampling.

    .venv/bin/python examples/bench/guided_rollout.py                 # specs/mintrl.yaml, toy testbed
    .venv/bin/python examples/bench/guided_rollout.py --prompts 8 --repeats 7 rollout.guide.chunk_tokens=24

Both sides sample the same prompts with the same engine and score their rollouts (behaviour
log-probs). The figure is wall time per generated policy token (discarded tokens included),
guided over plain: the target is <= 1.3x. Repeats are interleaved; medians are reported.
`composer bench --throughput` prints the same measurement (composer/bench/throughput.py: guided_overhead).
"""

from __future__ import annotations

import argparse
import sys
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

    from composer.bench.throughput import format_guided, guided_overhead

    torch.set_num_threads(args.threads)
    g = guided_overhead(None, args.prompts, args.repeats, args.overrides, spec=args.spec)
    print(format_guided(g))
    return 0


if __name__ == "__main__":
    sys.exit(main())
