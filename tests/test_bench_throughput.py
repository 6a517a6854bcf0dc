"""`composer bench --throughput`, tiny: both sides run the real step (ours: the Lightning module's own step,
ComposerModule.step_loss + after_step; TRL's trainer) and the command fails when a side did not run.
No timing is asserted: only that each side ran its blocks and the exit status says so."""

from __future__ import annotations

import importlib.util
import json

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("trl") is None, reason="needs trl (the bench extra)")
TINY_ARGS = ["--rounds", "1", "--steps", "1", "--warmup", "0", "--length", "4", "--prompts", "2", "--group", "2",
        "--threads", "1"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> list[str]:
    """An untrained tiny policy (no bootstrapped checkpoint needed): the bench's arguments for it."""
    from components.tasks.bootstrap import tiny_random_checkpoint

    return [*TINY_ARGS, "--model", tiny_random_checkpoint(str(tmp_path_factory.mktemp("tiny") / "policy"))]


def test_tiny_throughput_runs_both_sides_through_the_modules_step(tmp_path, monkeypatch, tiny):
    from composer.bench import throughput as bt
    from composer.backends.lightning.module import ComposerModule

    calls = []
    real = ComposerModule.step_loss

    def spy(self, step, optimizer):
        calls.append(step)
        return real(self, step, optimizer)

    monkeypatch.setattr(ComposerModule, "step_loss", spy)
    out = tmp_path / "tp.json"
    assert bt.main(["--pairs", "grpo", *tiny, "--json", str(out)]) == 0
    (res,) = json.loads(out.read_text())["results"]
    assert res["ours_error"] is None and res["trl_error"] is None, res
    assert len(res["ours_block_s"]) == 1 and len(res["trl_block_s"]) == 1
    assert res["ours_samples_per_s"] > 0 and res["trl_samples_per_s"] > 0
    assert calls == [0, 1]  # the check step, then the timed block: the module's own step ran


def test_throughput_exits_nonzero_when_a_side_did_not_run(tmp_path, capsys, monkeypatch, tiny):
    """Our side's step fails (as the private copy of the step once did, with every pair), and TRL's trainer
    cannot be built: the table says so and the exit status is 1 (it was 0)."""
    from composer.bench import throughput as bt
    from composer.backends.lightning.module import ComposerModule

    def broken(self, step, optimizer):
        raise TypeError("'Validated' object is not subscriptable")

    def no_trl(*_a, **_k):
        raise ImportError("trl is missing")

    monkeypatch.setattr(ComposerModule, "step_loss", broken)
    monkeypatch.setattr(bt, "trl_sft", no_trl)
    code = bt.main(["--pairs", "sft", *tiny])
    assert code == 1
    err = capsys.readouterr().err
    assert "a side did not run: sft ours: TypeError" in err and "a side did not run: sft trl: ImportError" in err
