#!/usr/bin/env bash
# GPU smoke test of the OpenRLHF backend on ONE node with ONE GPU, on the toy checkpoints (no downloads).
# Needs OpenRLHF 0.11.2 with vLLM, DeepSpeed, flash-attn and Ray installed next to the composer.
#   examples/cluster/smoke.sh                    # grpo, oapl, mintrl; 3 steps each
#   examples/cluster/smoke.sh --steps 5 --specs oapl
set -euo pipefail
cd "$(dirname "$0")/../.."
exec python examples/cluster/smoke.py "$@"
