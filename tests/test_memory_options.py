"""Memory options a 1-8B policy needs (issue 15), each on the tiny toy model: LoRA adapters through peft
(and the adapter-off base as the initial policy), gradient checkpointing, bf16-mixed precision."""

from __future__ import annotations

import csv
import math
from pathlib import Path

import pytest
import torch

from composer.runtime import checkpoint as ckpt_format
from composer.checks.validate import validate_file

ROOT = Path(__file__).resolve().parent.parent
FAST = ["train.prompts_per_step=2", "rollout.max_new_tokens=24", "train.eval_every=0", "train.eval_samples=2",
        "train.samples_every=0"]


def run(spec: str, tmp_path: Path, extra=(), name="run") -> Path:
    from composer.backends.lightning.run import train

    out = tmp_path / name
    train(validate_file(ROOT / spec, FAST + list(extra)), out, progress=False)
    return out


def rows(out: Path) -> list[dict]:
    with open(out / "metrics.csv", newline="") as f:
        return list(csv.DictReader(f))


def weights(out: Path) -> dict:
    state = ckpt_format.load(out / "checkpoints" / "last.ckpt")
    return {k[len("policy."):]: v for k, v in state["state_dict"].items() if k.startswith("policy.")}


def toy_student():
    from composer.runtime.models import load_model

    return load_model("toy:student")


def test_lora_trains_only_the_adapter_and_exports_merged_weights(tmp_path):
    from transformers import AutoModelForCausalLM

    out = run("specs/sft.yaml", tmp_path, ["policy.lora.r=4", "train.steps=3", "train.lr=1.0e-2"])
    w = weights(out)
    base = toy_student().state_dict()
    lora = {k: v for k, v in w.items() if "lora_" in k}
    assert lora and any(float(v.abs().sum()) > 0 for k, v in lora.items() if "lora_B" in k)  # the adapter moved
    for k, v in w.items():  # every base weight is the checkpoint it started from
        if "lora_" in k:
            continue
        name = k.replace("base_model.model.", "").replace(".base_layer", "")
        assert torch.equal(v, base[name]), k
    exported = AutoModelForCausalLM.from_pretrained(out / "model")
    assert not any("lora" in k for k in exported.state_dict())  # a plain transformers model
    ids = torch.tensor([[3, 5, 7, 9, 4]])
    from composer.runtime.models import prepare_policy
    from composer.lang.spec import Policy

    peft_model = prepare_policy(toy_student(), Policy(lora={"r": 4}))
    peft_model.load_state_dict(w)
    with torch.no_grad():
        assert torch.allclose(exported(ids).logits, peft_model(ids).logits, atol=1e-5)


def test_lora_initial_policy_is_the_base_with_the_adapter_off(tmp_path):
    """A `weights: initial` self-teacher (OPSD) on a LoRA policy reads the base model, not a copy."""
    from composer.runtime.context import RunContext
    from composer.runtime.models import AdapterOff, prepare_policy
    from composer.lang.spec import Policy

    policy = prepare_policy(toy_student(), Policy(lora={"r": 4}))
    with torch.no_grad():
        for n, p in policy.named_parameters():
            if "lora_B" in n:
                p.add_(0.5)  # a trained adapter
    ctx = RunContext(task=None, tokenizer=None, policy=policy, engine=None)
    initial = ctx.initial_policy()
    assert isinstance(initial, AdapterOff) and initial.state_dict() == {}
    ids = torch.tensor([[3, 5, 7, 9, 4]])
    with torch.no_grad():
        assert torch.allclose(initial(input_ids=ids).logits, toy_student()(input_ids=ids).logits, atol=1e-6)
        assert not torch.allclose(policy(input_ids=ids).logits, toy_student()(input_ids=ids).logits, atol=1e-3)
    out = run("specs/opsd.yaml", tmp_path, ["policy.lora.r=4", "train.steps=2"])
    assert all(math.isfinite(float(r["loss"])) for r in rows(out) if r.get("loss"))


def test_gradient_checkpointing_trains_the_same_weights(tmp_path):
    plain = weights(run("specs/sft.yaml", tmp_path, ["train.steps=2"], "plain"))
    ckpt = weights(run("specs/sft.yaml", tmp_path, ["train.steps=2", "policy.gradient_checkpointing=true"], "gc"))
    assert plain.keys() == ckpt.keys()
    for k in plain:
        assert torch.allclose(plain[k], ckpt[k], atol=1e-6), k


@pytest.mark.parametrize("spec", ["specs/sft.yaml", "specs/grpo.yaml"])
def test_bf16_mixed_precision_runs(spec, tmp_path):
    out = run(spec, tmp_path, ["train.steps=2", "train.precision=bf16-mixed"])
    losses = [float(r["loss"]) for r in rows(out) if r.get("loss")]
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses)
    w = weights(out)
    assert all(v.dtype == torch.float32 for v in w.values())  # mixed: the weights stay float32


# ------------------------------------------------------------------------------ LoRA on a tied lm_head (issue 29)


def test_lora_on_a_tied_lm_head_exports_the_trained_model(tiny, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    from composer.runtime.models import load_model, merged, prepare_policy
    from composer.lang.spec import Policy

    base = load_model(tiny)
    assert base.get_output_embeddings().weight is base.get_input_embeddings().weight  # tied
    embed_before = base.get_input_embeddings().weight.detach().clone()
    policy = prepare_policy(base, Policy(lora={"r": 4, "target_modules": ["q_proj", "lm_head"]}))
    torch.manual_seed(0)
    with torch.no_grad():  # "training": every adapter moves
        for name, p in policy.named_parameters():
            if "lora_" in name:
                p.add_(torch.randn_like(p) * 0.05)
    tokens = torch.randint(0, base.config.vocab_size, (2, 9))
    with torch.no_grad():
        trained = policy(input_ids=tokens).logits
    plain = merged(policy)
    plain.save_pretrained(tmp_path / "m")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "m")
    with torch.no_grad():
        exported = loaded(input_ids=tokens).logits
    assert torch.allclose(exported, trained, atol=1e-4), (exported - trained).abs().max()
    assert torch.equal(loaded.get_input_embeddings().weight, embed_before)
