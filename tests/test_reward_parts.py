"""Reward parts: DAPO's soft overlong punishment and the length penalty by hand, a signal that adds weighted
reward sources, and the spec language's plugin example (docs/spec-language.md) as a shipped, working example."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import torch

from components.sources.shaping import overlong_penalty

ROOT = Path(__file__).resolve().parent.parent


def test_overlong_penalty_by_hand():
    # L_max 10, L_cache 4: 0 up to 6 tokens, ((10 - 4) - |o|) / 4 inside (6, 10], -1 beyond 10
    got = overlong_penalty(torch.tensor([5.0, 6.0, 7.0, 9.0, 10.0, 12.0]), 10, 4)
    assert got.tolist() == [0.0, 0.0, -0.25, -0.75, -1.0, -1.0]
    assert overlong_penalty(torch.tensor([8.0]), 10, 4, factor=2.0).tolist() == [-1.0]


def test_reward_signal_adds_weighted_parts_and_logs_each():
    from components.signals.reward import RewardSignal
    from composer.batch import TrajectoryBatch
    from composer.origins import CODE

    P, O, D = CODE["prompt"], CODE["policy"], CODE["pad"]
    origin = torch.tensor([[P, O, O, O], [P, O, D, D]], dtype=torch.uint8)  # 3 and 1 response tokens
    batch = TrajectoryBatch(tokens=torch.ones(2, 4, dtype=torch.long), origin=origin,
                            behavior_logprobs=torch.zeros(2, 4), group=torch.tensor([0, 0]),
                            control=torch.ones(2, dtype=torch.bool))

    class Src:
        def __init__(self, r):
            self.r = r

        def rewards(self, ctx, b):
            return torch.tensor(self.r)

    from components.sources.shaping import LengthPenalty

    logged = {}

    class Ctx:
        spec = None  # no run spec: no environment's turn rewards

        def source(self, name):
            return {"verifier": Src([1.0, 0.0]), "fmt": Src([0.5, 0.5]), "len": LengthPenalty(coef=0.1)}[name]

        def log(self, **kw):
            logged.update(kw)

    sig = RewardSignal(source="verifier", plus={"fmt": 2.0, "len": 1.0})
    out = sig.apply(Ctx(), batch)
    # r = verifier + 2 * fmt + 1 * (-0.1 * |o|) = (1 + 1 - 0.3, 0 + 1 - 0.1)
    assert torch.allclose(out.rewards, torch.tensor([1.7, 0.9]))
    assert logged.keys() == {"reward/verifier", "reward/fmt", "reward/len"}  # unweighted means of each part
    assert [round(logged[k], 6) for k in ("reward/verifier", "reward/fmt", "reward/len")] == [0.5, 0.5, -0.2]


def test_the_readme_plugin_example_is_a_shipped_example_that_validates():
    page = (ROOT / "docs" / "spec-language.md").read_text()  # the spec-language key table, moved from README.md
    row = next(line for line in page.splitlines() if line.startswith("| `plugins` |"))
    module = re.search(r"plugins: \[(\w+)\]", row).group(1)
    folder = re.search(r"`(examples/[\w/]+)/`", row).group(1)
    assert (ROOT / folder / "src" / module).is_dir()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / folder / "src"), str(ROOT)])}
    r = subprocess.run([sys.executable, "-m", "composer", "validate", f"{folder}/spec.yaml", "--allow-plugins"],
                       env=env, capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert f"plugins: [{module}]" in (ROOT / folder / "spec.yaml").read_text()
