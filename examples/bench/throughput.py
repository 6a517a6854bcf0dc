"""Throughput of the composer's training step against TRL (GRPO, GKD/OPD, SFT), interleaved in one run.

    python examples/bench/throughput.py                      # toy student/teacher, all three pairs
    python examples/bench/throughput.py --pairs grpo --sampler fast --length 32

See examples/bench/README.md and composer/bench/throughput.py (the reusable module, main(argv)).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from composer.bench.throughput import main  # after the sys.path line

if __name__ == "__main__":
    sys.exit(main())
