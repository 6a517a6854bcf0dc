#!/usr/bin/env bash
# GPU smoke test of the OpenRLHF backend on ONE node with ONE GPU, on the toy checkpoints (no downloads).
# Six checks, in order, each read from the jobs' real logs (README.md in this folder says what each reads):
#   start, oapl_sync, phase_switch, int_stage1, loss_step0, opd_teacher
# Needs OpenRLHF 0.11.2 with vLLM, DeepSpeed, flash-attn and Ray installed next to the composer.
#   examples/cluster/smoke.sh                          # every check
#   examples/cluster/smoke.sh --only oapl_sync,loss_step0
# Exit 0: all passed; 1: a check failed; 2: this machine cannot run it (no GPU, missing packages).
set -euo pipefail
cd "$(dirname "$0")/../.."
exec python examples/cluster/smoke.py "$@"
