"""The OpenRLHF backend: `composer compile SPEC --backend openrlhf --out DIR` writes a launch bundle.

  flags.py    spec -> OpenRLHF runs: native flags where they exist, the plugin for the rest
  parser.py   OpenRLHF's real argument parser, rebuilt from the installed wheel (every command is checked)
  bundle.py   writes plan.json, args.json, command.txt, launch.sh, README.md, reward.py, agent.py, data/
  __main__    `python -m composer.backends.openrlhf --plan plan.json --run NAME -- ARGS`: installs the
              composer's hooks and starts OpenRLHF's trainer
  hooks.py    the patches, installed in every Ray worker (worker_process_setup_hook)
  batch.py    Experience <-> TrajectoryBatch, the label side channel
  loss.py     where composer/step.py runs: the experience maker's whole step, the loss that replaces PolicyLoss
  agent.py    the AgentExecutor: composer/step.py's per-row program (guides, row targets)
  reward.py   reward_func over the composer's verifiers

Importing this package imports nothing heavy (no torch, no OpenRLHF).
"""

OPENRLHF_VERSION = "0.11.2"
