"""examples/gpu/throughput_vllm.py cannot run without a GPU: it compiles, and its CPU-testable parts (argument
parsing, the bench arguments it builds, the table) work."""

from __future__ import annotations

import importlib.util
import py_compile
from argparse import Namespace
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "gpu" / "throughput_vllm.py"


@pytest.fixture(scope="module")
def script():
    py_compile.compile(str(SCRIPT), doraise=True)
    spec = importlib.util.spec_from_file_location("throughput_vllm", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_arguments_and_refusals(script, capsys):
    a = script.parse_args([])
    assert (a.prompts, a.group, a.length, a.gpu_memory_utilization) == (8, 8, 32, 0.3)
    for bad in (["--group", "0"], ["--gpu-memory-utilization", "0.8"]):
        with pytest.raises(SystemExit) as e:
            script.parse_args(bad)
        assert e.value.code == 2
    assert "--gpu-memory-utilization must be in (0, 0.5)" in capsys.readouterr().err


def test_bench_arguments_ask_for_vllm_on_both_sides(script):
    b = script.bench_args(script.parse_args(["--prompts", "4", "--length", "64", "--model", "/m"]))
    assert (b.pairs, b.modes, b.length, b.prompts, b.model, b.device) == ("grpo", "matched", 64, 4, "/m", "cuda")
    assert "rollout.engine=vllm" in b.override
    assert b.trl_grpo_extra == {"use_vllm": True, "vllm_mode": "colocate", "vllm_gpu_memory_utilization": 0.3}


def test_table(script):
    args = Namespace(prompts=8, group=8, length=32, rounds=2, steps=2, warmup=1, gpu_memory_utilization=0.3)
    res = {"ours_block_s": [0.5, 0.7], "trl_block_s": [1.0, 1.4], "ours_samples_per_s": 213.3,
           "trl_samples_per_s": 106.7, "ours_tokens_per_s": 6826.0, "trl_tokens_per_s": 3413.0, "ratio": 2.0,
           "round_ratios": [2.0, 2.0], "ours_error": None, "trl_error": "ValueError: no vLLM"}
    text = script.format_table(res, {"ours": [0.010, 0.014], "trl": []}, args)
    lines = text.splitlines()
    assert lines[1].split()[:3] == ["side", "samples/s", "tokens/s"]
    ours = next(line for line in lines if line.startswith("ours (rollout.engine: vllm)"))
    assert "213.3" in ours and " 300 " in ours and "12.0" in ours  # (0.5+0.7)/2 s / 2 steps; mean sync 12 ms
    trl = next(line for line in lines if line.startswith("TRL GRPOTrainer"))
    assert "106.7" in trl and " 600 " in trl
    assert "ours/TRL samples/s: 2.00x (rounds 2.00-2.00)" in text
    assert "trl did not run: ValueError: no vLLM" in text
