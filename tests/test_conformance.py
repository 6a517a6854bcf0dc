"""Conformance: for every spec we ship, the run does what the spec declares (issue 13).

Each spec runs a few steps on the toy testbed with a recorder installed (RunContext.record). The checks
read what actually ran and recompute it independently of the code that produced it:
  - every sampled token's behaviour log-prob equals a fresh forward pass of the rollout weights that
    wrote it (at the batch's temperature), whatever path produced it (chunks, corrections, prefixes);
  - guide-written tokens carry a behaviour log-prob exactly when an objective of the segment reads it;
  - the tokens that receive gradient (autograd of each term's loss w.r.t. the policy's log-probs) have
    only the origins plan.json says get loss (a token whose gradient happens to be 0, e.g. all advantages
    0, is not seen by this check; cross-entropy terms always have one);
  - every declared privileged context that has a text for a row appears in the prompt the model saw;
  - segments start, and rollout weights sync, at the steps the plan declares (recomputed here from the
    plan's numbers, not with the run's own schedule function), and the weights that sampled each step's
    rollouts are those of the policy after the last declared sync (fingerprints of the parameters,
    independent of the run's own sync bookkeeping);
  - the objective in force at each step is the one plan.json gives the step's segment, and a segment
    without a guide writes no guide tokens;
  - offpolicy_token_frac in metrics.csv recounts from the trained batch.
A divergence reintroduced anywhere (a zeroed log-prob, a dropped context, a missed sync, a stale phase)
fails here.
"""

from __future__ import annotations

import csv
import hashlib
from pathlib import Path

import pytest
import torch
import yaml

from composer.origins import ORIGINS
from composer.plan import compile_plan
from composer.validate import validate_file

ROOT = Path(__file__).resolve().parent.parent
SPECS = (sorted((ROOT / "specs").glob("*.yaml")) + sorted((ROOT / "specs" / "hybrids").glob("*.yaml"))
         + sorted((ROOT / "specs" / "methods").glob("*.yaml")))
FAST = ["train.prompts_per_step=2", "rollout.max_new_tokens=16", "train.eval_every=0", "train.eval_samples=2",
        "train.checkpoint_every=1000"]
GUIDE_ORIGINS = ("guide_prefix", "guide_intervention")
TOL = 2e-3  # float32 forward passes of different shapes (KV cache vs one pass)


def short(path: Path) -> list[str]:
    """Overrides that run every segment of the spec for 1-2 steps and sync within the run."""
    data = yaml.safe_load(path.read_text())
    v = validate_file(path)
    out = list(FAST)
    if data.get("stages"):
        out += [f"stages.{i}.train.steps=2" for i in range(len(data["stages"]))]
    elif data.get("phases"):
        out += [f"train.steps={2 * len(data['phases'])}"]
        out += [f"phases.{i}.until={2 * (i + 1)}" for i in range(len(data["phases"]))]
    else:
        out += ["train.steps=3"]
    if any(s.spec.sync.every > 2 for s in v.segments) and not data.get("stages"):
        out += ["sync.every=2"]
    return out


def fingerprint(model) -> str:
    """A digest of every parameter's bytes (two models with equal weights give the same string)."""
    h = hashlib.sha1()
    for p in model.parameters():
        h.update(p.detach().float().cpu().numpy().tobytes())
    return h.hexdigest()


class Recorder:
    def __init__(self):
        self.events: list[tuple[str, dict]] = []
        self.logprob_errors: list[tuple] = []
        self.policy_at: dict[int, str] = {}  # step -> the trained weights before that step's update
        self.rollout_at: dict[int, str] = {}  # step -> the weights that sampled that step's rollouts

    def __call__(self, kind, **data):
        if kind == "rollout":  # check now: the rollout weights are the ones that sampled this batch
            self.check_behaviour(data["batch"], data["engine"], data["step"])
            self.policy_at.setdefault(data["step"], fingerprint(data["policy"]))
            self.rollout_at.setdefault(data["step"], fingerprint(data["engine"].model))
        if kind == "term_loss":  # now, before backward frees the graph
            data["grad_origins"] = self.grad_origins(data["loss"], data["view"], data["batch"])
        self.events.append((kind, data))

    @staticmethod
    def grad_origins(loss, view, batch):
        """Origins of the tokens whose log-prob the term's loss actually depends on (autograd, not masks)."""
        if not loss.requires_grad or not view.logprobs.requires_grad:
            return None
        (grad,) = torch.autograd.grad(loss, view.logprobs, retain_graph=True, allow_unused=True)
        if grad is None:
            return set()
        return {ORIGINS[c] for c in batch.origin[grad.abs() > 0].unique().tolist()}

    def check_behaviour(self, batch, engine, step):
        model = engine.model
        dev = next(model.parameters()).device
        with torch.no_grad():
            logits = model(input_ids=batch.tokens.to(dev), attention_mask=batch.attention_mask.long().to(dev)).logits
        lp = torch.log_softmax(logits.float() / batch.info.get("temperature", 1.0), -1)
        fresh = torch.zeros(batch.tokens.shape)
        fresh[:, 1:] = lp[:, :-1].gather(-1, batch.tokens[:, 1:, None].to(dev)).squeeze(-1).cpu()
        known = batch.known_mask & batch.response_mask
        err = (fresh - batch.behavior_logprobs.cpu()).abs()[known.cpu()]
        if err.numel() and float(err.max()) > TOL:
            self.logprob_errors.append((step, float(err.max()), int((err > TOL).sum()), int(err.numel())))


def run_recorded(path: Path, tmp_path: Path, extra=()):
    from composer.backends.lightning.run import train

    v = validate_file(path, short(path) + list(extra))
    rec = Recorder()
    train(v, tmp_path / "run", progress=False, recorder=rec)
    with open(tmp_path / "run" / "metrics.csv", newline="") as f:
        rows = {int(r["step"]): r for r in csv.DictReader(f)}
    return v, compile_plan(v), rec, rows


def expected_syncs(plan: dict) -> list[int]:
    """Optimiser steps after which the rollout weights refresh: every sync.every steps counted from each
    segment's start, and at the end of every stage (the next stage starts from its final weights)."""
    out = []
    segs = plan["segments"]
    for k, seg in enumerate(segs):
        every = seg["sync"]["every"]
        out += [d for d in range(seg["start"] + 1, seg["end"] + 1) if (d - seg["start"]) % every == 0]
        nxt = segs[k + 1] if k + 1 < len(segs) else None
        if nxt is not None and nxt.get("stage") != seg.get("stage") and seg["end"] not in out:
            out.append(seg["end"])
    return sorted(set(d for d in out if d <= plan["total_steps"]))


def segment_of(plan: dict, step: int) -> dict:
    return next(s for s in plan["segments"] if s["start"] <= step < s["end"])


@pytest.mark.parametrize("path", SPECS, ids=lambda p: str(p.relative_to(ROOT)))
def test_spec_runs_as_declared(path, tmp_path):
    from composer.terms import scored_origins

    v, plan, rec, rows = run_recorded(path, tmp_path)
    events = rec.events

    # 1. behaviour log-probs: a fresh forward pass of the rollout weights that sampled
    assert not rec.logprob_errors, f"behaviour log-probs differ from the rollout weights: {rec.logprob_errors}"

    # 2. guide tokens carry a behaviour log-prob exactly when an objective of their segment reads it
    for kind, e in events:
        if kind != "rollout":
            continue
        batch, seg = e["batch"], segment_of(plan, e["step"])
        spec = next(s.spec for s in v.segments if s.name == seg["name"])
        policy = batch.mask(("policy",))
        assert bool(batch.known_mask[policy].all()), "a policy token without its sampling log-prob"
        for o in GUIDE_ORIGINS:
            m = batch.mask((o,))
            if m.any():
                want = o in scored_origins(spec)
                assert bool((batch.known_mask[m] == want).all()), f"{o}: known must be {want}"

    # 3. gradient reaches exactly the origins plan.json trains
    for kind, e in events:
        if kind != "term_loss" or e["grad_origins"] is None:
            continue
        seg = segment_of(plan, e["step"])
        term = next(t for t in seg["token_origins"] if t["term"] == e["term"])
        trained = {o for o, x in term["origins"].items() if x["loss"]}
        got = e["grad_origins"]
        assert got <= trained, f"{e['term']} at step {e['step']}: gradient on {got - trained}"

    # 4. every declared context with a text for a row is in the prompt the model saw
    prompts = [e for k, e in events if k == "prompt"]
    for e in prompts:
        for name, text in e["context"].items():
            if text is not None:
                assert text in e["text"], f"{e['source']} ({e['usage']}): context '{name}' missing from its prompt"
    declared = {(n, u) for seg in v.segments for n, s in seg.spec.sources.items()
                if s.kind_name() == "policy_model" and s.context for u in ("teacher", "judge")}
    for e in prompts:
        declared.discard((e["source"], e["usage"].split("_")[0]))
    # sources with context that were read this run saw their context at least once
    for seg in v.segments:
        for n, s in seg.spec.sources.items():
            if s.kind_name() == "policy_model" and s.context and any(e["source"] == n for e in prompts):
                assert any(t is not None for e in prompts if e["source"] == n for t in e["context"].values())

    # 5. the objective in force is the plan's for the step's segment; no guide, no guide tokens
    for kind, e in events:
        if kind == "term_loss":
            seg = segment_of(plan, e["step"])
            want = next(t["objective"] for t in seg["terms"] if t["name"] == e["term"])
            got = {"kind": e["objective"].kind_name(),
                   **e["objective"].model_dump(mode="json", by_alias=True, exclude={"kind"})}
            assert got == want, f"step {e['step']}: objective {got} in force, the plan says {want}"
        if kind == "rollout" and segment_of(plan, e["step"])["guide"] in (None, {"kind": "none"}):
            assert not e["batch"].mask(GUIDE_ORIGINS).any(), f"step {e['step']}: guide tokens with no guide"

    # 5b. segments start and weights sync at the declared steps
    starts = [(e["name"], e["step"]) for k, e in events if k == "segment"]
    assert starts == [(s["name"], s["start"]) for s in plan["segments"]]
    syncs = [e["after"] for k, e in events if k == "sync"]
    assert syncs == expected_syncs(plan)
    # the weights that sampled step s are the policy's after the last declared sync at or before s
    declared = expected_syncs(plan)
    for s, fp in rec.rollout_at.items():
        last = max([d for d in declared if d <= s] + [0])
        if last in rec.policy_at:  # an SFT stage samples nothing, so its weights are not seen
            assert fp == rec.policy_at[last], f"step {s}: rollouts sampled by weights other than those after step {last}"

    # 6. offpolicy_token_frac recounts from the batch that trained
    for kind, e in events:
        if kind == "term_loss" and e["term"] == "term0" and "offpolicy_token_frac" in rows.get(e["step"], {}):
            b = e["batch"]
            resp = b.response_mask
            off = b.mask(("guide_prefix", "guide_intervention", "demonstration")) & resp
            logged = rows[e["step"]]["offpolicy_token_frac"]
            if logged and b.rewards is not None:
                assert float(logged) == pytest.approx(float(off.sum() / resp.sum().clamp(min=1)), abs=1e-6)


def test_conformance_catches_zeroed_guide_logprobs(tmp_path, monkeypatch):
    """The check fails when a guide's tokens lose their behaviour log-probs (issue 13's first divergence):
    a Proxy-anchored MInTRL run whose scored intervention tokens are zeroed again."""
    import composer.runtime.rollout as rollout_mod

    monkeypatch.setattr(rollout_mod, "fill_scores", lambda trace, lps, origins: [
        setattr(p, "logprobs", [0.0] * len(p.tokens)) for p in trace.pieces
        if p.logprobs is None and p.origin in origins])
    _v, _plan, rec, _rows = run_recorded(ROOT / "specs" / "hybrids" / "mintrl-self-proxy.yaml", tmp_path)
    assert rec.logprob_errors, "zeroed behaviour log-probs went unnoticed"


def test_conformance_catches_a_dropped_context(tmp_path, monkeypatch):
    """The check fails when a teacher's declared context does not reach its prompt (the second divergence)."""
    import composer.runtime.prompts as prompts

    real = prompts.context_block
    monkeypatch.setattr(prompts, "check_placement", lambda *a: None)  # the pre-training check would stop it first
    monkeypatch.setattr(prompts, "context_block", lambda task, kinds, texts: real(task, kinds, {n: None for n in texts}))
    with pytest.raises(AssertionError, match="missing from its prompt"):
        test_spec_runs_as_declared(ROOT / "specs" / "opsd.yaml", tmp_path)


def test_conformance_catches_a_missed_sync(tmp_path, monkeypatch):
    """A rollout engine that stops refreshing its weights (its sync reported as done) fails the fingerprint
    check, which does not trust the run's own sync events."""
    from composer.runtime.engine import HFEngine

    monkeypatch.setattr(HFEngine, "sync", lambda self, policy, step: setattr(self, "last_sync", step))
    with pytest.raises(AssertionError, match="rollouts sampled by weights other than"):
        test_spec_runs_as_declared(ROOT / "specs" / "oapl.yaml", tmp_path)


def test_conformance_catches_a_stale_phase(tmp_path, monkeypatch):
    """A run that stays in its first phase (the objective of phase 0 after the switch) fails the check of
    the objective in force."""
    import composer.backends.lightning.module as module

    real = module.ComposerModule.segment_at
    monkeypatch.setattr(module.ComposerModule, "segment_at", lambda self, step: real(self, 0))
    with pytest.raises(AssertionError, match="gradient on|in force"):  # the first check to see it
        test_spec_runs_as_declared(ROOT / "specs" / "hybrids" / "sft-opd-grpo.yaml", tmp_path)


def test_conformance_catches_loss_on_tokens_the_plan_masks(tmp_path, monkeypatch):
    """An objective whose loss mask also takes the prompt tokens fails the gradient check."""
    from components.objectives.base import Objective

    monkeypatch.setattr(Objective, "loss_mask", lambda self, batch: batch.attention_mask)
    with pytest.raises(AssertionError, match="gradient on"):
        test_spec_runs_as_declared(ROOT / "specs" / "sft.yaml", tmp_path)


EXAMPLES = sorted((ROOT / "examples").rglob("*.yaml"))


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: str(p.relative_to(ROOT)))
def test_example_spec_runs_as_declared(path, tmp_path):
    """Example specs may name plugin modules: the same check in a fresh process, with the example's own
    src/ importable and spec plugins allowed (this process's registry stays as the schema tests expect)."""
    import os
    import subprocess
    import sys

    src = [str(p) for p in path.parent.glob("src")]
    code = ("import sys, pathlib; import test_conformance as t; "
            f"t.test_spec_runs_as_declared(pathlib.Path({str(path)!r}), pathlib.Path({str(tmp_path)!r}))")
    env = {**os.environ, "COMPOSER_ALLOW_PLUGINS": "1",
           "PYTHONPATH": os.pathsep.join(src + [str(ROOT / "tests"), str(ROOT)])}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
