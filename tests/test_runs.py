"""End-to-end runs of the Lightning backend on CPU: smoke runs, resume, errors that lose nothing."""

from __future__ import annotations

import csv
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from _helpers import NO_TRUST, REPO, cli, composer, run_spec

from composer.checks.validate import validate_file

ROOT = Path(__file__).resolve().parent.parent
FAST = ["train.prompts_per_step=2", "rollout.samples_per_prompt=2", "rollout.max_new_tokens=12",
        "train.eval_every=0", "train.eval_samples=2"]
SFT_FAST = [o for o in FAST if not o.startswith("rollout.samples")]  # SFT samples no rollouts (the setting is refused)


@pytest.fixture(scope="session")
def tiny(tmp_path_factory) -> str:
    from components.tasks.bootstrap import tiny_random_checkpoint

    return tiny_random_checkpoint(str(tmp_path_factory.mktemp("tiny")))


def rows(path: Path) -> list[dict]:
    with open(path / "metrics.csv", newline="") as f:
        return list(csv.DictReader(f))


def run(spec: str, out: Path, overrides: list[str], resume: bool = False):
    from composer.backends.lightning.run import train

    v = validate_file(ROOT / spec, overrides)
    return train(v, out, resume=resume, progress=False)


@pytest.mark.parametrize("spec", ["specs/sft.yaml", "specs/grpo.yaml", "specs/oapl.yaml"])
def test_smoke_run_writes_what_a_run_keeps(spec, tiny, tmp_path):
    final = run(spec, tmp_path, [f"policy.model={tiny}", "train.steps=2",
                                 *(SFT_FAST if spec.endswith("sft.yaml") else FAST)])
    for name in ("plan.json", "metrics.csv", "report.md", "curves.png", "checkpoints/last.ckpt"):
        assert (tmp_path / name).exists(), name
    got = rows(tmp_path)
    assert [r["step"] for r in got] == ["0", "1", "2"]  # two updates, then the final evaluation's row
    for column in ("loss", "entropy", "response_len", "offpolicy_token_frac"):
        assert got[1][column] != ""
    assert got[2]["pass_at_1/tier6"] != "" and got[2]["loss"] == ""
    assert set(final) == {f"pass@1/tier{t}" for t in (1, 2, 4, 6, 8)}


def test_lagged_sync_keeps_rollout_weights_fixed(tiny, tmp_path):
    """sync.every=3: the rollout copy changes only at steps 3 and 6."""
    import torch

    from composer.backends.lightning import module as mod

    seen = []
    original = mod.ComposerModule.after_step

    def spy(self):
        before = [p.clone() for p in self.ctx.engine.model.parameters()]
        original(self)
        after = list(self.ctx.engine.model.parameters())
        seen.append((self.global_step, any(not torch.equal(a, b) for a, b in zip(before, after))))

    mod.ComposerModule.after_step = spy
    try:
        # SFT moves the weights every step even on a random model (rewards would all be 0)
        run("specs/sft.yaml", tmp_path, [f"policy.model={tiny}", "train.steps=7", "sync.every=3", *SFT_FAST])
    finally:
        mod.ComposerModule.after_step = original
    assert [s for s, changed in seen if changed] == [3, 6]


def test_non_finite_loss_stops_with_step_and_keeps_checkpoint(tiny, tmp_path, monkeypatch):
    from components.objectives import grpo
    from composer.backends.lightning.module import NonFiniteError

    run("specs/grpo.yaml", tmp_path, [f"policy.model={tiny}", "train.steps=2", "train.checkpoint_every=1", *FAST])
    good = (tmp_path / "checkpoints" / "last.ckpt").read_bytes()
    real = grpo.Grpo.loss

    def poisoned(self, batch, cur, adv):
        value, m = real(self, batch, cur, adv)
        return value * float("nan"), m

    monkeypatch.setattr(grpo.Grpo, "loss", poisoned)
    with pytest.raises(NonFiniteError, match="step 2"):
        run("specs/grpo.yaml", tmp_path, [f"policy.model={tiny}", "train.steps=4", "train.checkpoint_every=1", *FAST],
            resume=True)
    assert (tmp_path / "checkpoints" / "last.ckpt").read_bytes() == good


def _cli(args, **kw):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.Popen([sys.executable, "-m", "composer", *args], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **kw)


def test_sigkill_mid_run_then_resume_matches_uninterrupted_run(tiny, tmp_path):
    args = ["specs/oapl.yaml", f"policy.model={tiny}", "train.steps=6", "train.checkpoint_every=2",
            "sync.every=2", *FAST, "--no-progress"]
    ref = _cli(["run", *args, "--out", str(tmp_path / "ref")])
    assert ref.wait(timeout=300) == 0, ref.stdout.read()

    out = tmp_path / "killed"
    p = _cli(["run", *args, "--out", str(out)])
    ckpt = out / "checkpoints" / "last.ckpt"
    deadline = time.time() + 240
    while not ckpt.exists() and time.time() < deadline and p.poll() is None:
        time.sleep(0.05)
    time.sleep(0.3)  # somewhere inside a later step
    p.send_signal(signal.SIGKILL)
    p.wait()
    r = _cli(["run", "--resume", str(out), "--no-progress"])
    assert r.wait(timeout=300) == 0, r.stdout.read()

    want, got = rows(tmp_path / "ref"), rows(out)
    assert [x["step"] for x in got] == [x["step"] for x in want]
    for a, b in zip(want, got):
        for key in ("loss", "reward_mean", "entropy", "response_len", "adv_mean", "logratio_mean"):
            assert a[key] == b[key], (a["step"], key)
    from composer.runtime import checkpoint as ckpt_format

    wa, wb = (ckpt_format.load(d / "checkpoints" / "last.ckpt") for d in (tmp_path / "ref", out))
    assert wa["global_step"] == wb["global_step"] == 6  # the last step's state is always checkpointed
    assert all(torch.equal(wa["state_dict"][k], wb["state_dict"][k]) for k in wa["state_dict"])


def test_sigterm_writes_a_checkpoint_and_stops_cleanly(tiny, tmp_path):
    out = tmp_path / "run"
    p = _cli(["run", "specs/grpo.yaml", f"policy.model={tiny}", "train.steps=200", "train.checkpoint_every=1000",
              *FAST, "--no-progress", "--out", str(out)])
    deadline = time.time() + 120
    while time.time() < deadline and p.poll() is None:
        if (out / "metrics.csv").exists() and len(rows(out)) >= 1:
            break
        time.sleep(0.05)
    p.send_signal(signal.SIGTERM)
    assert p.wait(timeout=120) == 130
    assert (out / "checkpoints" / "last.ckpt").exists()
    assert "--resume" in p.stdout.read()


def test_bad_model_directory_names_the_path(tmp_path):
    p = subprocess.run([sys.executable, "-m", "composer", "run", "specs/grpo.yaml", f"policy.model={tmp_path}",
                        "--out", str(tmp_path / "o"), "--no-progress"], cwd=ROOT, capture_output=True, text=True)
    assert p.returncode == 2
    assert str(tmp_path) in p.stderr and "Traceback" not in p.stderr


def test_reuse_trains_on_the_buffer_until_the_next_sync(tiny, tmp_path):
    run("specs/oapl.yaml", tmp_path / "a", [f"policy.model={tiny}", "train.steps=6", "sync.every=3",
                                            "sync.reuse=true", *FAST])
    got = rows(tmp_path / "a")
    assert [r["buffer_reused"] for r in got if r["loss"]] == ["0.0", "1.0", "1.0", "0.0", "1.0", "1.0"]
    assert got[0]["response_len"] == got[1]["response_len"] == got[2]["response_len"]
    # clear_buffer: false keeps the older interval's rollouts next to the new ones
    run("specs/oapl.yaml", tmp_path / "b", [f"policy.model={tiny}", "train.steps=6", "sync.every=3",
                                            "sync.reuse=true", "sync.clear_buffer=false", *FAST])
    sizes = [r["buffer_rows"] for r in rows(tmp_path / "b") if r["buffer_reused"] == "0.0"]
    assert sizes == ["4.0", "8.0"]


def test_compiled_forwards_train_the_same_weights(tiny, tmp_path, monkeypatch):
    """train.compile: the same loss and the same updated weights as the uncompiled run; checkpoints keep
    the plain module's keys."""
    import torch

    from composer.runtime import fast_sampler

    compiled_models = []
    real_compile = torch.compile

    def spy(model, **kw):
        compiled_models.append(getattr(model, "__name__", type(model).__name__))
        return real_compile(model, **kw)

    monkeypatch.setattr(torch, "compile", spy)
    monkeypatch.setattr(fast_sampler, "_COMPILED", None)  # built inside this test, not by an earlier one
    decode_steps = []
    real_step = fast_sampler.compiled_step
    monkeypatch.setattr(fast_sampler, "compiled_step",
                        lambda: (lambda *a: decode_steps.append(1) or real_step()(*a)))
    ovr = FAST + [f"policy.model={tiny}", "train.steps=1", "train.checkpoint_every=1"]
    run("specs/grpo.yaml", tmp_path / "plain", ovr)
    assert compiled_models == [] and decode_steps == []
    run("specs/grpo.yaml", tmp_path / "compiled", ovr + ["train.compile=true"])
    # the policy and the initial policy (GRPO's KL), and the rollout engine's decode step, which ran
    assert len(compiled_models) == 3 and compiled_models.count("_decode_step") == 1
    assert len(decode_steps) > 0
    a, b = rows(tmp_path / "plain")[0], rows(tmp_path / "compiled")[0]
    assert float(b["loss"]) == pytest.approx(float(a["loss"]), rel=1e-4, abs=1e-6)
    weights = [torch.load(tmp_path / run_ / "checkpoints" / "last.ckpt", map_location="cpu",
                          weights_only=False)["state_dict"] for run_ in ("plain", "compiled")]
    assert weights[0].keys() == weights[1].keys() and not any("_orig_mod" in k for k in weights[1])
    for k in weights[0]:
        torch.testing.assert_close(weights[1][k], weights[0][k], rtol=1e-4, atol=1e-6)


def test_reading_only_the_loss_positions_trains_the_same_weights(tiny, tmp_path, monkeypatch):
    """SFT's policy forward promises only the positions its loss and the entropy metric read
    (`Objective.read_mask`, the completions): it skips the last layer's MLP and the LM head at the prompts, and
    trains the same loss and weights as a run that computes every position (COMPOSER_READ_ONLY=0). The skip
    ran: the last MLP saw fewer rows than the first. (GRPO's rows share their group's prompt, so its forward
    takes the shared-prefix path, which computes every position.)"""
    spec = "specs/sft.yaml"
    from composer.runtime import varlen

    seen = []
    real = varlen.logits

    def spy(model, tokens, mask, read=None):
        inner = varlen.unwrapped(model)
        hooks = [layer.mlp.down_proj.register_forward_hook(
            lambda _m, a, _o, i=i: seen.append((i, a[0].numel() // a[0].shape[-1])))
            for i, layer in ((0, inner.model.layers[0]), (1, inner.model.layers[-1]))]
        try:
            return real(model, tokens, mask, read)
        finally:
            for h in hooks:
                h.remove()

    ovr = SFT_FAST + [f"policy.model={tiny}", "train.steps=2", "train.checkpoint_every=1"]
    monkeypatch.setenv("COMPOSER_READ_ONLY", "0")
    run(spec, tmp_path / "all", ovr)
    monkeypatch.setenv("COMPOSER_READ_ONLY", "1")
    monkeypatch.setattr(varlen, "logits", spy)
    run(spec, tmp_path / "read", ovr)
    pairs = list(zip(seen[::2], seen[1::2]))  # (first layer, last layer) rows of each flat forward
    assert any(last < first for (_, first), (_, last) in pairs), pairs
    a, b = rows(tmp_path / "all"), rows(tmp_path / "read")
    for ra, rb in zip(a[:2], b[:2]):
        assert float(rb["loss"]) == pytest.approx(float(ra["loss"]), rel=1e-5, abs=1e-7)
        assert float(rb["entropy"]) == pytest.approx(float(ra["entropy"]), rel=1e-5, abs=1e-7)
    weights = [torch.load(tmp_path / r / "checkpoints" / "last.ckpt", map_location="cpu",
                          weights_only=False)["state_dict"] for r in ("all", "read")]
    for k in weights[0]:
        torch.testing.assert_close(weights[1][k], weights[0][k], rtol=1e-5, atol=1e-7)


# -------------------------------------------------------------------------- non-finite weights and gradients (issue 17)


def test_non_finite_weights_are_never_checkpointed(tiny, tmp_path, monkeypatch):
    from composer.backends.lightning import module as mod
    from composer.backends.lightning.module import NonFiniteError

    out = tmp_path / "run"
    ov = [f"policy.model={tiny}", "train.checkpoint_every=1", *FAST]
    run_spec(REPO / "specs/grpo.yaml", out, ov + ["train.steps=1"])
    good = (out / "checkpoints" / "last.ckpt").read_bytes()
    real = mod.ComposerModule.after_step

    def poison(self):  # finite gradients, a weight driven to inf (what weight_decay: 1e300 did)
        real(self)
        with torch.no_grad():
            next(self.policy.parameters()).fill_(float("inf"))

    monkeypatch.setattr(mod.ComposerModule, "after_step", poison)
    with pytest.raises(NonFiniteError, match="not finite after step 2; no checkpoint was written"):
        run_spec(REPO / "specs/grpo.yaml", out, ov + ["train.steps=3"], resume=True)
    assert (out / "checkpoints" / "last.ckpt").read_bytes() == good


def test_a_non_finite_gradient_stops_the_step_and_an_overflowing_norm_does_not():
    """The gradient check before each optimiser step: one fused norm, then a per-tensor look only when the
    norm is not finite. A NaN or an infinity in any gradient stops the step; finite gradients whose norm
    overflows float32 (1e30 each) do not."""
    from types import SimpleNamespace

    from composer.backends.lightning.module import ComposerModule, NonFiniteError

    policy = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2, bias=False))
    host = SimpleNamespace(policy=policy, global_step=7, ctx=None)  # ctx None: no critic head to step
    check = ComposerModule.on_before_optimizer_step
    check(host, None)  # no gradients yet
    for p in policy.parameters():
        p.grad = torch.ones_like(p)
    check(host, None)
    for p in policy.parameters():
        p.grad = torch.full_like(p, 1e30)
    assert not torch.isfinite(torch.nn.utils.get_total_norm([p.grad for p in policy.parameters()]))
    check(host, None)  # the norm overflows, every gradient is finite
    for bad in (float("nan"), float("inf"), float("-inf")):
        for p in policy.parameters():
            p.grad = torch.ones_like(p)
        policy[1].weight.grad[1, 2] = bad
        with pytest.raises(NonFiniteError, match="a gradient is not finite at step 7"):
            check(host, None)


# ---------------------------------------------------------------------------- a signal before the first step (issue 17)


@pytest.mark.parametrize("inherited", ["default", "ignored"])
def test_sigint_before_training_exits_130(tmp_path, inherited):
    """Also when started as a script's background job (`composer run ... &`), which inherits SIGINT ignored:
    a signal during validation was lost there and the run trained to the end with exit status 0."""
    disposition = signal.SIG_IGN if inherited == "ignored" else signal.SIG_DFL
    p = subprocess.Popen([sys.executable, "-m", "composer", "run", "specs/grpo.yaml", "--out", tmp_path / "o",
                          "--no-progress"], cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, disposition))
    time.sleep(1.0 if inherited == "default" else 0.3)  # importing and validating: long before the first step
    # again every 0.25 s until it exits: an ignored SIGINT that comes before `composer run` restores the handler
    # is dropped (the process cannot see it), and setup lasts seconds, so one lands in it on a loaded machine too
    # (and no more once it says it stopped: a second SIGINT would land in its exit)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(p.stdout), daemon=True)
    reader.start()
    for _ in range(240):
        if any("stopped before training" in line for line in lines):
            break
        p.send_signal(signal.SIGINT)
        try:
            p.wait(timeout=0.25)
            break
        except subprocess.TimeoutExpired:
            pass
    p.wait(timeout=120)
    reader.join(timeout=30)
    out = "".join(lines)
    # 130; or, where one of this loop's later SIGINTs landed while the process was already exiting after its stop
    # message (1 run in 58 on 2 busy cores, cause not found: the run's code ignores SIGINT from the message on),
    # killed by that signal: the stop itself happened before training either way
    stopped = "stopped before training" in out
    assert p.returncode == 130 or (p.returncode == -signal.SIGINT and stopped), out[-2000:]
    assert stopped and "Traceback" not in out and not (tmp_path / "o").exists()


def test_a_signal_during_setup_inside_fit_stops_before_the_first_step(tiny, tmp_path, monkeypatch):
    """Lightning turns a KeyboardInterrupt inside fit into exit status 1: there a signal is only recorded."""
    from composer.backends.lightning import module as mod
    from composer.backends.lightning.run import Interrupted

    real = mod.ComposerModule.setup

    def signalled_setup(self, stage):
        real(self, stage)
        os.kill(os.getpid(), signal.SIGINT)

    monkeypatch.setattr(mod.ComposerModule, "setup", signalled_setup)
    with pytest.raises(Interrupted, match="stopped before the first step"):
        run_spec(REPO / "specs/grpo.yaml", tmp_path / "o", [f"policy.model={tiny}", "train.steps=3", *FAST])
    assert not (tmp_path / "o" / "metrics.csv").exists()


# ----------------------------------------- settings this machine cannot honour, a node that never comes (issues 17, 29)


def test_multi_node_without_a_launcher_is_refused_not_hung(tiny, tmp_path):
    r = composer("run", "specs/grpo.yaml", f"policy.model={tiny}", "train.num_nodes=2", *FAST, "--out",
                 tmp_path / "o", "--no-progress", timeout=120)
    assert r.returncode == 2 and "no multi-node launcher" in r.stderr and not (tmp_path / "o").exists()


@pytest.mark.parametrize("override, message", [
    ("train.strategy=fsdp", "Lightning cannot run this here"),
    ("train.devices=[0,1]", "Lightning cannot run this here"),
    ("policy.lora.target_modules=[nope_proj]", "the model's linear modules are"),
    ("policy.lora.target_modules=[]", "at least 1 item"),
])
def test_settings_this_machine_or_model_cannot_honour(tiny, tmp_path, override, message):
    import torch

    if "strategy" in override or "devices" in override:
        if torch.cuda.is_available():
            pytest.skip("a GPU machine can honour it")
    r = cli("run", "specs/sft.yaml", f"policy.model={tiny}", "train.steps=1", "train.prompts_per_step=2",
            "train.eval_every=0", "train.eval_samples=2", override, "--out", tmp_path / "o", "--no-progress")
    assert r.exit_code == 2 and message in r.stderr and "internal error" not in r.stderr, r.output[-2000:]
    assert not (tmp_path / "o").exists()


@pytest.mark.slow
def test_sigterm_stops_a_run_waiting_for_a_second_node(tiny, tmp_path):
    import signal
    import socket
    import time

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    env = {**os.environ, "PYTHONPATH": str(REPO), **NO_TRUST, "NODE_RANK": "0", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(port)}
    p = subprocess.Popen([sys.executable, "-m", "composer", "run", "specs/sft.yaml", f"policy.model={tiny}",
                          "train.steps=1", "train.prompts_per_step=2", "train.eval_every=0", "train.eval_samples=2",
                          "train.num_nodes=2", "train.accelerator=cpu", "--out", str(tmp_path / "o"),
                          "--no-progress"], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and p.poll() is None:  # rank 0 listens: it waits for node 1 now
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.5)
        assert p.poll() is None, p.communicate()[1][-2000:]
        time.sleep(2)
        p.send_signal(signal.SIGTERM)
        out, err = p.communicate(timeout=60)  # before: waited forever, SIGTERM ignored
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode != 0 and "Traceback" not in err, err[-2000:]
