"""Rollout engines: the interface in real Lightning runs (sync schedule, behaviour log-probs), the hf
engine's lagged weights, the auto fallback, and the vLLM engine's logic against a fake `vllm` module."""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
import math
import subprocess
import sys
import types
from pathlib import Path
from types import SimpleNamespace as NS
from typing import ClassVar

import pytest
import torch

import composer.runtime.engine as engine_mod
from composer.runtime.engine import Generation, HFEngine, Sampling, engine_factory, make_engine

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from components.tasks.bootstrap import tiny_random_checkpoint

    return tiny_random_checkpoint(str(tmp_path_factory.mktemp("tiny") / "ckpt"))


@pytest.fixture(scope="module")
def tiny_model(tiny):
    from composer.runtime.models import load_model, load_tokenizer

    return load_model(tiny), load_tokenizer(tiny)


def short_run(tiny, tmp_path, steps, every, extra=()):
    from composer.backends.lightning.run import train
    from composer.checks.validate import validate_file

    v = validate_file(ROOT / "specs" / "oapl.yaml", [
        f"policy.model={tiny}", f"train.steps={steps}", f"sync.every={every}", "train.prompts_per_step=2",
        "rollout.samples_per_prompt=2", "rollout.max_new_tokens=8", "train.eval_every=0", "train.eval_samples=2",
        "train.checkpoint_every=100", *extra])
    return train(v, tmp_path / "run", progress=False)


# ------------------------------------------------------------------------ a fake engine in a real run


def fake_logprobs(seq: list[int]) -> list[float]:
    """Distinctive, deterministic per-token values (exactly representable in float32)."""
    return [0.0] + [-(j % 5 + 1) / 8 - (t % 3) / 64 for j, t in enumerate(seq[1:], 1)]


class FakeEngine:
    """Deterministic generate/score/sync; records what the run asked of it."""

    name = "fake"
    exact_logprobs = True

    def __init__(self, policy, tokenizer):
        self.tok = tokenizer
        self.syncs: list[int] = []
        self.generated_at: list[int] = []  # number of syncs seen at each generate call
        self.last_sync = 0
        self.digits = tokenizer.encode("0123456789+-=\n", add_special_tokens=False)

    def generate(self, prompts, max_new_tokens, sampling: Sampling) -> list[Generation]:
        self.generated_at.append(len(self.syncs))
        caps = max_new_tokens if isinstance(max_new_tokens, list) else [max_new_tokens] * len(prompts)
        out = []
        for i, (p, cap) in enumerate(zip(prompts, caps)):
            n = 1 + (sum(p) + i) % cap
            toks = [self.digits[(sum(p) + 3 * i + j) % len(self.digits)] for j in range(n)]
            if n < cap:
                toks[-1] = self.tok.eos_token_id
            # a sampler reports each token's log-prob with it
            out.append(Generation(toks, toks[-1] == self.tok.eos_token_id, fake_logprobs(list(p) + toks)[len(p):]))
        return out

    def score(self, sequences, temperature: float = 1.0):
        return [fake_logprobs(list(s)) for s in sequences]

    def sync(self, policy, step: int) -> None:
        self.syncs.append(step)
        self.last_sync = step


def test_fake_engine_sync_schedule_and_behaviour_logprobs(tiny, tmp_path, monkeypatch):
    import composer.step as run_step

    engines: list[FakeEngine] = []
    kinds: list[str] = []

    def factory(kind, policy, tokenizer, rollout_cfg):
        kinds.append(kind)
        engines.append(FakeEngine(policy, tokenizer))
        return engines[-1]

    seen = []
    real_loss = run_step.loss

    def spy_loss(at, batches, *args, **kwargs):
        seen.append(batches[0])
        return real_loss(at, batches, *args, **kwargs)

    monkeypatch.setattr(run_step, "loss", spy_loss)
    with engine_factory(factory):
        short_run(tiny, tmp_path, steps=7, every=3)
    assert engine_mod._ENGINE_FACTORY is None  # the hook is undone after the block
    (eng,) = engines
    assert kinds == ["auto"]
    assert eng.syncs == [3, 6]  # exactly after optimiser steps 3 and 6
    assert eng.generated_at == [0, 0, 0, 1, 1, 1, 2]  # steps 0-2 before any sync, 3-5 after the first
    assert len(seen) == 7
    for b in seen:  # the engine's reported log-probs arrive unchanged in batch.behavior_logprobs
        for r in range(b.size):
            real = b.origin[r] != 0
            resp = b.response_mask[r].cpu()
            seq = b.tokens[r][real].tolist()
            expect = torch.tensor(fake_logprobs(seq), dtype=b.behavior_logprobs.dtype)
            assert torch.equal(b.behavior_logprobs[r].cpu()[resp], expect[resp[real.cpu()]])


# ---------------------------------------------------------------- the hf engine's weights lag the policy


def test_hf_engine_weights_fixed_between_syncs(tiny, tmp_path):
    checks = []

    class SpyHF(HFEngine):
        def __init__(self, policy, tokenizer):
            super().__init__(policy, tokenizer)
            self.policy = policy
            self.at_sync = {k: v.clone() for k, v in self.model.state_dict().items()}
            self.syncs = []

        def sync(self, policy, step):
            super().sync(policy, step)
            self.at_sync = {k: v.detach().clone() for k, v in policy.state_dict().items()}
            self.syncs.append(step)

        def generate(self, prompts, max_new_tokens, sampling):
            mine = self.model.state_dict()
            live = self.policy.state_dict()
            checks.append((all(torch.equal(mine[k], self.at_sync[k]) for k in mine),
                           all(torch.equal(mine[k], live[k].to(mine[k].device)) for k in mine)))
            return super().generate(prompts, max_new_tokens, sampling)

    spies = []
    with engine_factory(lambda kind, policy, tok, cfg: spies.append(SpyHF(policy, tok)) or spies[-1]):
        short_run(tiny, tmp_path, steps=5, every=2, extra=["train.entropy_coef=0.1", "train.lr=0.01"])
    assert spies[0].syncs == [2, 4]
    assert [same_as_last_sync for same_as_last_sync, _ in checks] == [True] * 5
    # equal to the live policy at the start and right after a sync, different in between
    assert [same_as_policy for _, same_as_policy in checks] == [True, False, True, False, True]


# ------------------------------------------------------------------------------- choosing the engine


def test_auto_falls_back_to_hf_without_vllm(tiny_model, caplog, monkeypatch):
    policy, tok = tiny_model
    monkeypatch.setitem(sys.modules, "vllm", None)  # `import vllm` raises ImportError
    with caplog.at_level(logging.INFO, logger="composer"):
        eng = make_engine("auto", policy, tok)
    assert isinstance(eng, HFEngine)
    assert "rollout engine: auto -> hf (vLLM is not installed" in caplog.text
    with pytest.raises(RuntimeError, match="rollout.engine: vllm was asked for, but vLLM is not installed"):
        make_engine("vllm", policy, tok)


def test_auto_falls_back_to_hf_without_gpu(tiny_model, caplog, monkeypatch):
    policy, tok = tiny_model
    monkeypatch.setitem(sys.modules, "vllm", types.ModuleType("vllm"))  # installed ...
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # ... but no GPU
    with caplog.at_level(logging.INFO, logger="composer"):
        eng = make_engine("auto", policy, tok)
    assert isinstance(eng, HFEngine)
    assert "rollout engine: auto -> hf (no GPU is present" in caplog.text
    with pytest.raises(RuntimeError, match="vllm was asked for, but no GPU is present"):
        make_engine("vllm", policy, tok)


def test_hf_engine_rollout_copy_follows_policy_device(tiny_model):
    policy, tok = tiny_model
    eng = HFEngine(policy, tok)
    assert eng.model is not policy and eng.device == next(policy.parameters()).device
    eng._policy = NS(parameters=lambda: iter([torch.empty(0, device="meta")]))  # the trainer moved the policy
    eng._follow_device()
    assert eng.device == torch.device("meta")


# ----------------------------------------------------------------- the vLLM engine against a fake vllm


@dataclasses.dataclass
class FakeSamplingParams:
    n: int = 1
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    stop_token_ids: list | None = None
    detokenize: bool = True


@dataclasses.dataclass
class FakeEngineArgsOld:  # a vLLM without logprobs_mode
    model: str = ""
    tokenizer: str = ""
    seed: int = 0
    gpu_memory_utilization: float = 0.9
    tensor_parallel_size: int = 1
    enable_prefix_caching: bool = False
    enable_sleep_mode: bool = False
    dtype: str = "auto"
    max_logprobs: int = 20


@dataclasses.dataclass
class FakeEngineArgs(FakeEngineArgsOld):
    logprobs_mode: str = "raw_logprobs"


VOCAB = 8  # the fake model's distribution over token ids 0..7


def fake_dist(context: list[int]) -> list[float]:
    """The fake model's raw next-token log-probs after `context`."""
    z = torch.tensor([((sum(context) + 3 * v) % 7) / 3 for v in range(VOCAB)], dtype=torch.float64)
    return torch.log_softmax(z, 0).tolist()


class FakeModel:
    def __init__(self):
        self.loaded: list[dict] = []

    def load_weights(self, weights):
        self.loaded.append({k: v.detach().clone() for k, v in weights})


class FakeLLM:
    """Token-id generation (samples the lowest token ids, so the test can predict them), prompt log-probs,
    sleep/wake and an in-process model, as vLLM has them."""

    instances: ClassVar[list] = []

    def __init__(self, in_process=True, **kwargs):
        self.kwargs = kwargs
        self.calls: list[FakeSamplingParams] = []
        self.events: list[str] = []
        self.model = FakeModel()
        if in_process:
            runner = NS(model=self.model)
            self.llm_engine = NS(model_executor=NS(driver_worker=NS(worker=NS(model_runner=runner))))
        FakeLLM.instances.append(self)

    def generate(self, inputs, params, use_tqdm=True):
        per_row = params if isinstance(params, list) else [params] * len(inputs)  # vLLM takes either
        self.calls.append(per_row[0])
        out = []
        for i, (inp, params) in enumerate(zip(inputs, per_row)):
            p = list(inp["prompt_token_ids"])
            if params.prompt_logprobs is not None:
                plp = [None]
                for j in range(1, len(p)):
                    d = fake_dist(p[:j])
                    keep = range(VOCAB) if params.prompt_logprobs else [p[j]]
                    plp.append({v: NS(logprob=d[v]) for v in keep})
                out.append(NS(prompt_logprobs=plp, outputs=[NS(token_ids=[1], logprobs=None, finish_reason="length")]))
                continue
            toks, lps, ctx = [], [], list(p)
            n = 2 + i % 3  # 2, 3, 4 tokens
            for j in range(min(n, params.max_tokens)):
                t = 7 if j == n - 1 else 2 + j  # 7 plays EOS
                toks.append(t)
                lps.append({t: NS(logprob=-0.25 * (j + 1) - 0.5 * params.temperature)})
                ctx.append(t)
                if t == 7:
                    break
            finish = "stop" if toks[-1] == 7 else "length"
            out.append(NS(prompt_logprobs=None, outputs=[
                NS(token_ids=toks, logprobs=lps if params.logprobs is not None else None, finish_reason=finish)]))
        return out

    def sleep(self, level=1):
        self.events.append(f"sleep{level}")

    def wake_up(self, tags=None):
        self.events.append("wake:" + ",".join(tags or []))

    def reset_prefix_cache(self):
        self.events.append("reset")


@pytest.fixture
def fake_vllm(monkeypatch):
    vllm = types.ModuleType("vllm")
    vllm.__version__ = "0.0-fake"
    vllm.SamplingParams = FakeSamplingParams
    vllm.EngineArgs = FakeEngineArgs
    vllm.LLM = FakeLLM
    inputs = types.ModuleType("vllm.inputs")
    inputs.TokensPrompt = lambda **kw: dict(kw)
    vllm.inputs = inputs
    monkeypatch.setitem(sys.modules, "vllm", vllm)
    monkeypatch.setitem(sys.modules, "vllm.inputs", inputs)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("COMPOSER_VLLM_SLEEP", "0")
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    FakeLLM.instances.clear()
    return vllm


class Tok:
    eos_token_id = 7
    pad_token_id = 0

    def __len__(self):
        return VOCAB


def rollout_cfg(**kw):
    base = dict(engine="vllm", temperature=1.0, top_p=1.0, top_k=0, gpu_memory_utilization=0.4,
                tensor_parallel_size=1)
    return NS(**{**base, **kw})


def test_vllm_engine_builds_llm_from_spec_and_pushes_initial_weights(fake_vllm, tiny_model):
    from composer.runtime.vllm_engine import VLLMEngine

    policy, tok = tiny_model
    eng = make_engine("vllm", policy, tok, rollout_cfg())
    try:
        assert isinstance(eng, VLLMEngine)
        kw = FakeLLM.instances[-1].kwargs
        assert kw["model"] == policy.name_or_path and kw["gpu_memory_utilization"] == 0.4
        assert kw["tensor_parallel_size"] == 1 and kw["enable_prefix_caching"] is True
        assert kw["logprobs_mode"] == "processed_logprobs" and kw["enable_sleep_mode"] is False
        assert eng.exact_logprobs and eng.processed_logprobs
        (loaded,) = FakeLLM.instances[-1].model.loaded  # the trainer's weights, pushed at start
        assert set(loaded) == set(policy.state_dict())
        assert all(torch.equal(loaded[k], v) for k, v in policy.state_dict().items())
        assert all(torch.equal(eng.model.state_dict()[k], v) for k, v in policy.state_dict().items())
    finally:
        eng.close()


def test_vllm_engine_sampled_logprobs_guides_and_sync(fake_vllm):
    from composer.runtime.vllm_engine import VLLMEngine

    llm = FakeLLM()
    eng = VLLMEngine(None, Tok(), rollout_cfg(temperature=0.5, top_p=0.9), model_dir="m", llm=llm)
    prompts = [[1, 2], [3], [4, 4, 4]]
    gens = eng.generate(prompts, 3, Sampling(temperature=0.5, top_p=0.9))
    p = llm.calls[-1]
    assert (p.temperature, p.top_p, p.top_k, p.logprobs) == (0.5, 0.9, -1, 0)
    assert (p.stop_token_ids, p.detokenize) == ([7], False)
    assert [g.tokens for g in gens] == [[2, 7], [2, 3, 7], [2, 3, 4]]
    assert [g.finished for g in gens] == [True, True, False]

    # score: the sampler's own log-probs where it wrote the token; a prefill (tempered) for the prompt
    seqs = [pr + g.tokens for pr, g in zip(prompts, gens)]
    scored = eng.score(seqs, 0.5)
    pre = llm.calls[-1]
    assert pre.prompt_logprobs == VOCAB and pre.max_tokens == 1  # the full distribution, tempered here
    for pr, g, row in zip(prompts, gens, scored):
        assert row[0] == 0.0 and len(row) == len(pr) + len(g.tokens)
        assert row[len(pr):] == [-0.25 * (j + 1) - 0.25 for j in range(len(g.tokens))]
        for j in range(1, len(pr)):
            expect = torch.log_softmax(torch.tensor(fake_dist(pr[:j]), dtype=torch.float64) / 0.5, 0)[pr[j]]
            assert math.isclose(row[j], float(expect), rel_tol=1e-9)

    # a guide: chunk 1, then resume from the accepted prefix plus an intervention token (5)
    (g1,) = eng.generate([[1, 2]], 2, Sampling(temperature=0.5))
    resumed = [1, 2] + g1.tokens[:1] + [5]
    (g2,) = eng.generate([resumed], 3, Sampling(temperature=0.5))
    (row,) = eng.score([resumed + g2.tokens], 0.5)
    assert row[2] == -0.5 and row[4:] == [-0.25 * (j + 1) - 0.25 for j in range(len(g2.tokens))]
    expect = torch.log_softmax(torch.tensor(fake_dist(resumed[:3]), dtype=torch.float64) / 0.5, 0)[5]
    assert math.isclose(row[3], float(expect), rel_tol=1e-9)  # the intervention token: rescored

    # sync: in place, the prefix cache reset, the checkpointable copy updated
    lin = torch.nn.Linear(2, 2)
    eng.sync(lin, 3)
    assert eng.last_sync == 3 and llm.events[-1] == "reset"
    assert torch.equal(llm.model.loaded[-1]["weight"], lin.weight)
    assert torch.equal(eng.model.state_dict()["weight"], lin.weight)


def test_vllm_engine_sync_fails_clearly_without_a_way_in(fake_vllm):
    from composer.runtime.vllm_engine import VLLMEngine

    eng = VLLMEngine(None, Tok(), rollout_cfg(), model_dir="m", llm=FakeLLM(in_process=False))
    with pytest.raises(RuntimeError, match=r"vLLM 0.0-fake: could not load the trainer's weights.*in-process"):
        eng.sync(torch.nn.Linear(2, 2), 1)


def test_vllm_engine_without_logprobs_mode_rescores(fake_vllm, monkeypatch):
    from composer.runtime.vllm_engine import VLLMEngine

    monkeypatch.setattr(fake_vllm, "EngineArgs", FakeEngineArgsOld)
    llm = FakeLLM()
    eng = VLLMEngine(None, Tok(), rollout_cfg(temperature=0.7), model_dir="m", llm=llm)
    assert not eng.processed_logprobs and not eng.exact_logprobs
    (g,) = eng.generate([[1, 2]], 3, Sampling(temperature=0.7))
    assert llm.calls[-1].logprobs is None  # raw log-probs would not be the sampler's: not asked for
    (row,) = eng.score([[1, 2] + g.tokens], 0.7)
    seq = [1, 2] + g.tokens
    for j in range(1, len(seq)):
        expect = torch.log_softmax(torch.tensor(fake_dist(seq[:j]), dtype=torch.float64) / 0.7, 0)[seq[j]]
        assert math.isclose(row[j], float(expect), rel_tol=1e-9)


def test_vllm_engine_sleeps_during_the_loss_and_wakes_for_rollouts(fake_vllm):
    from composer.runtime.vllm_engine import VLLMEngine

    policy = torch.nn.Linear(2, 2)
    policy.name_or_path = "m"
    llm = FakeLLM()
    eng = VLLMEngine(policy, Tok(), rollout_cfg(), llm=llm, sleep=True)
    llm.events.clear()
    eng.generate([[1]], 2, Sampling())
    assert llm.events == []  # awake
    with torch.no_grad():
        policy(torch.zeros(1, 2))  # evaluation / scoring forwards do not end the rollout
    assert llm.events == []
    policy(torch.zeros(1, 2)).sum().backward()  # the trainer's loss forward: sleep
    assert llm.events == ["sleep1"] and eng._records.size == 0
    eng.sync(policy, 1)  # weights wake for the sync, the KV cache stays asleep
    assert llm.events[1:] == ["wake:weights", "reset"]
    eng.generate([[1]], 2, Sampling())
    assert llm.events[3:] == ["wake:kv_cache", "reset"]
    eng.close()


def test_engine_note(monkeypatch):
    import composer.runtime.vllm_engine as ve

    assert ve._vllm_here() == (False, "vLLM is not installed", "")  # this machine
    assert ve.engine_note(rollout_cfg(engine="auto")).startswith(
        "exact_logprobs: yes - engine hf (auto: vLLM is not installed)")
    assert ve.engine_note(rollout_cfg(engine="hf", top_p=0.9)).startswith("exact_logprobs: no - engine hf:")
    assert ve.engine_note(rollout_cfg(engine="vllm")).startswith(
        "exact_logprobs: unknown - engine vllm, but vLLM is not installed")
    assert engine_mod.engine_note(rollout_cfg(engine="hf")).startswith("exact_logprobs: yes - engine hf:")
    monkeypatch.setattr(ve, "_vllm_here", lambda: (True, "", "0.0-fake"))
    monkeypatch.setattr(ve, "_source_has_logprobs_mode", lambda: True)
    assert ve.engine_note(rollout_cfg(engine="auto", temperature=0.6, top_p=0.95)).startswith(
        "exact_logprobs: yes - engine vllm 0.0-fake: the sampler's own log-probs after temperature 0.6")
    monkeypatch.setattr(ve, "_source_has_logprobs_mode", lambda: False)
    assert ve.engine_note(rollout_cfg(temperature=0.7)).startswith("exact_logprobs: no - engine vllm 0.0-fake has no")
    assert ve.engine_note(rollout_cfg(temperature=1.0)).startswith("exact_logprobs: yes - engine vllm 0.0-fake: no")


def test_engine_note_imports_neither_torch_nor_vllm():
    probe = ("import sys; from composer.runtime.vllm_engine import engine_note; from types import SimpleNamespace; "
             "print(engine_note(SimpleNamespace(engine='auto'))); "
             "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'vllm', 'transformers')))")
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT, check=False)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == ["exact_logprobs: yes - engine hf (auto: vLLM is not installed): behaviour "
                                     "log-probs from one forward pass of the rollout weights at temperature 1, the "
                                     "distribution that sampled", "[]"]


# ------------------------------------------------------------------------------------ the GPU example


def test_gpu_example_helps_and_fails_clearly_without_gpu(monkeypatch, capsys):
    spec = importlib.util.spec_from_file_location("vllm_vs_hf", ROOT / "examples" / "gpu" / "vllm_vs_hf.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    with pytest.raises(SystemExit) as e:
        mod.main(["--help"])
    assert e.value.code == 0 and "--steps" in capsys.readouterr().out
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        mod.main(["--methods", "grpo"])
    assert mod.overrides("oapl", "vllm", mod.parse([]))[-1] == "sync.every=10"
