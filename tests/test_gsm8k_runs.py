"""GSM8K as it comes (issue 43): rows whose `answer` is GSM8K's worked solution ending `#### 46`, a model SFT'd
on them writes that form, and a GRPO run with `verifier: math` on it gets non-zero reward (before: every answer
unparsed, reward 0 at every step, no warning). A run whose verifier parses nothing warns with the counts."""

from __future__ import annotations

import csv
import json
import random
from pathlib import Path

import pytest
import realmodel

from composer.runtime.reward_watch import RewardWatch


@pytest.fixture(scope="module")
def real(tmp_path_factory) -> dict:
    return realmodel.built(tmp_path_factory)


def gsm8k_rows(n: int, seed: int) -> list[dict]:
    """GSM8K's two columns: `question`, and `answer` = worked solution with <<calc>> marks and `#### N`."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        a, b = rng.randrange(1, 4), rng.randrange(1, 4)
        out.append({"question": f"Tom has {a} apples and buys {b} more. How many apples does he have?",
                    "answer": f"{a} + {b} = <<{a}+{b}={a + b}>>{a + b}\n#### {a + b}"})
    return out


def write_jsonl(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def metrics(out: Path) -> list[dict]:
    with open(out / "metrics.csv", newline="") as f:
        return list(csv.DictReader(f))


GRPO = """sources: {verifier: {kind: outcome_reward, verifier: math}}
rollout: {samples_per_prompt: 4, max_new_tokens: 40, temperature: 1.0}
signal: {kind: reward, source: verifier}
objective: {kind: grpo}
"""
SFT = """sources: {reference: {kind: reference_solution}}
signal: {kind: sft, target: reference}
objective: {kind: cross_entropy, loss_tokens: [demonstration]}
"""


def spec(path: Path, model: str, data: dict, body: str, train: dict) -> Path:
    path.write_text(f"name: g\npolicy: {{model: {json.dumps(model)}}}\ndata: {json.dumps(data)}\n{body}"
                    f"train: {json.dumps(train)}\n")
    return path


def test_a_segment_whose_verifier_parsed_nothing_warns_with_the_counts(real, tmp_path, cli, caplog):
    """A random model on GSM8K rows: no answer parsed at any step; the run says so at the end (before: silent)."""
    data = {"train": write_jsonl(tmp_path / "train.jsonl", gsm8k_rows(8, 0)), "prompt_field": "question",
            "answer_field": "answer"}
    s = spec(tmp_path / "g.yaml", real["model"], data, GRPO.replace("max_new_tokens: 40", "max_new_tokens: 6"),
             {"steps": 2, "prompts_per_step": 2, "eval_every": 0, "loggers": ["csv"]})
    r = cli("run", s, "--no-progress", "--out", tmp_path / "run")
    assert r.exit_code == 0, r.output
    rows = metrics(tmp_path / "run")
    assert all(float(x["unparsed_frac"]) == 1.0 for x in rows if x.get("unparsed_frac"))
    text = r.output + caplog.text
    assert "the verifier parsed no final answer in any of 2 step(s), 16 rollouts" in text, text


def test_reward_watch_counts_and_stays_quiet_when_the_reward_varies():
    from composer.data import Verdict

    class B:
        def __init__(self, verdicts):
            self.info = {"verdicts": verdicts}

    w = RewardWatch()
    w.note("grpo", [B([Verdict(0.0, parsed=False), Verdict(0.0, parsed=False)])])
    w.note("grpo", [B([Verdict(0.0, parsed=False)])])
    w.note("sft", [B([])])  # no verifier in the segment: nothing to say
    w.note("flat", [B([Verdict(1.0), Verdict(1.0)])])
    w.note("fine", [B([Verdict(1.0), Verdict(0.0, parsed=False)])])
    lines = w.problems()
    assert len(lines) == 2
    assert lines[0].startswith("segment 'grpo': the verifier parsed no final answer in any of 2 step(s), 3 rollouts")
    assert lines[1].startswith("segment 'flat': the reward was 1.0 for every one of 1 step(s), 2 rollouts (2 parsed)")


@pytest.mark.slow
def test_grpo_on_gsm8k_rows_after_sft_gets_reward_from_the_math_verifier(real, tmp_path, cli):
    """The own-data path (docs/own-model-and-data.md) on GSM8K as it comes: SFT on the `answer` column, then GRPO
    with verifier: math from the SFT's export, then `composer eval` on the GRPO export. Before: reward 0 and
    unparsed_frac 1.0."""
    rows = gsm8k_rows(16, 0)
    data = {"train": write_jsonl(tmp_path / "train.jsonl", rows), "eval": write_jsonl(tmp_path / "eval.jsonl", rows[:4]),
            "prompt_field": "question", "answer_field": "answer", "solution_field": "answer"}
    sft = spec(tmp_path / "sft.yaml", real["model"], data, SFT,
               {"steps": 80, "prompts_per_step": 8, "lr": 1.0e-2, "eval_every": 0, "loggers": ["csv"]})
    assert (r := cli("run", sft, "--no-progress", "--out", tmp_path / "sft")).exit_code == 0, r.output
    grpo = spec(tmp_path / "grpo.yaml", str(tmp_path / "sft" / "model"), data, GRPO,
                {"steps": 3, "prompts_per_step": 4, "lr": 1.0e-4, "eval_every": 0, "eval_samples": 4,
                 "loggers": ["csv"]})
    assert (r := cli("run", grpo, "--no-progress", "--out", tmp_path / "grpo")).exit_code == 0, r.output
    got = metrics(tmp_path / "grpo")
    steps = [x for x in got if x.get("reward_mean")]
    assert max(float(x["reward_mean"]) for x in steps) > 0, steps
    assert min(float(x["unparsed_frac"]) for x in steps) < 1.0
    samples = [json.loads(x) for x in (tmp_path / "grpo" / "samples.jsonl").read_text().splitlines()]
    assert any(s["reward"] > 0 and "####" in s["response"] for s in samples)
    assert "parsed no final answer" not in r.output


def test_an_export_evaluates_as_its_run_did(real, tmp_path, cli):
    """`composer eval EXPORT --data D` on an export away from its run folder uses the run's prompt and data
    settings (system prompt, template, fields, verifier, sizes) from composer_export.json. Before: `field
    'prompt': missing` (the default prompt_field), or other prompts and the math verifier."""
    import shutil

    from composer.backends.lightning.run import train
    from composer.checks.validate import validate_file

    data = {"train": real["train"], "eval": real["eval"], "prompt_field": "problem", "system_prompt": "Be brief.",
            "prompt_template": "Q: {prompt}\nA:"}
    s = spec(tmp_path / "s.yaml", real["model"], data,
             GRPO.replace("verifier: math", "verifier: exact").replace("max_new_tokens: 40", "max_new_tokens: 8"),
             {"steps": 1, "prompts_per_step": 2, "eval_every": 0, "eval_samples": 3, "loggers": ["csv"]})
    out = tmp_path / "run"
    final = train(validate_file(s), out, progress=False)
    moved = tmp_path / "elsewhere" / "model"
    shutil.copytree(out / "model", moved)
    r = cli("eval", moved, "--data", real["eval"], "--out", tmp_path / "ev")
    assert r.exit_code == 0, r.output
    ev = json.loads((tmp_path / "ev" / "eval.json").read_text())
    assert ev["verifier"] == "exact" and ev["eval_samples"] == 3 and ev["metrics"] == final
    want = [json.loads(x) for x in (out / "eval_samples.jsonl").read_text().splitlines()]
    got = [json.loads(x) for x in (tmp_path / "ev" / "eval_samples.jsonl").read_text().splitlines()]
    assert [x["prompt"] for x in got] == [x["prompt"] for x in want if x["step"] == 1]
    assert all("Be brief." in x["prompt"] and "Q: Tom has" in x["prompt"] for x in got)
    assert [x["response"] for x in got] == [x["response"] for x in want if x["step"] == 1]
