"""PPO with a learned critic (issue 46, part 5): GAE, the value loss and the reward-model source.

Hand-computed numbers on a 1-row, 4-token batch; OpenRLHF 0.11.2's own functions (GAE, compute_reward, the advantage
whitening of compute_advantages_and_returns, ValueLoss, its reward model's score at the last token) on random
batches, read from the installed wheel's source (its modules import flash-attn and DeepSpeed at the top, which do not
load on a CPU machine; the functions themselves are plain torch); TRL's PPOTrainer GAE loop on the same batch."""

from __future__ import annotations

import ast
import importlib.util
import json
import logging
import math
import types
from pathlib import Path

import pytest
import torch

from _helpers import openrlhf_code, openrlhf_env as _openrlhf_env
from components.objectives.ppo import Ppo, gae, reward_kl, token_rewards, value_loss_tokens, whiten
from composer.batch import TrajectoryBatch
from composer.origins import CODE

ROOT = Path(__file__).resolve().parent.parent
HAVE_OPENRLHF = importlib.util.find_spec("openrlhf") is not None
needs_openrlhf = pytest.mark.skipif(not HAVE_OPENRLHF, reason="openrlhf is not installed")


# --------------------------------------------------------------------------------------- hand-computed numbers

def test_gae_and_returns_by_hand():
    """1 row, 2 prompt tokens, 4 action tokens; gamma 0.9, lambda 0.8, beta 0.5, R = 1 at the last token.
    r = -0.5 [0.1, -0.2, 0, 0.3] + [0, 0, 0, 1] = [-0.05, 0.1, 0, 0.85]; V = [0.5, 0.2, -0.1, 0.3], V_4 = 0
    delta = [-0.05 + 0.9*0.2 - 0.5, 0.1 - 0.09 - 0.2, 0 + 0.27 + 0.1, 0.85 - 0.3] = [-0.37, -0.19, 0.37, 0.55]
    A_3 = 0.55, A_2 = 0.37 + 0.72*0.55 = 0.766, A_1 = -0.19 + 0.72*0.766 = 0.36152,
    A_0 = -0.37 + 0.72*0.36152 = -0.1097056;  G = A + V."""
    mask = torch.tensor([[False, False, True, True, True, True]])
    values = torch.tensor([[9.0, 9.0, 0.5, 0.2, -0.1, 0.3]])  # prompt positions are never read
    kl = torch.tensor([[7.0, 7.0, 0.1, -0.2, 0.0, 0.3]])
    r = token_rewards(torch.tensor([1.0]), mask, kl, 0.5)
    assert torch.allclose(r, torch.tensor([[0, 0, -0.05, 0.1, 0.0, 0.85]]), atol=1e-7)
    adv, ret = gae(r, values, mask, 0.9, 0.8)
    want = [-0.1097056, 0.36152, 0.766, 0.55]
    assert torch.allclose(adv[0, 2:], torch.tensor(want), atol=1e-6)
    assert torch.allclose(ret[0, 2:], torch.tensor([-0.1097056 + 0.5, 0.36152 + 0.2, 0.766 - 0.1, 0.55 + 0.3]), atol=1e-6)
    assert adv[0, :2].abs().sum() == 0 and ret[0, :2].abs().sum() == 0
    # lambda 1: the discounted return minus V; lambda 0: the one-step TD error
    a1, _ = gae(r, values, mask, 0.9, 1.0)
    assert math.isclose(float(a1[0, 2]), -0.05 + 0.9 * 0.1 + 0.81 * 0.0 + 0.729 * 0.85 - 0.5, abs_tol=1e-6)
    a0, _ = gae(r, values, mask, 0.9, 0.0)
    assert torch.allclose(a0[0, 2:], torch.tensor([-0.37, -0.19, 0.37, 0.55]), atol=1e-6)
    # whitened over the 4 action tokens: mean 0.3919536, biased variance
    w = whiten(adv, mask, "mean_std")[0, 2:]
    mean = sum(want) / 4
    std = math.sqrt(sum((a - mean) ** 2 for a in want) / 4)
    assert torch.allclose(w, torch.tensor([(a - mean) / std for a in want]), atol=1e-5)
    assert torch.allclose(whiten(adv, mask, "mean")[0, 2:], torch.tensor([a - mean for a in want]), atol=1e-6)


def test_an_action_gap_is_skipped_not_a_step():
    """A position off the action mask (a guide's token) between actions is not a step of the recursion: the
    advantages of the actions around it equal those of the same actions written contiguously."""
    r = torch.tensor([[0.0, 0.1, 0.0, -0.2, 1.0]])
    v = torch.tensor([[0.0, 0.3, 5.0, 0.1, 0.2]])
    gap = torch.tensor([[False, True, False, True, True]])
    a, _ = gae(r, v, gap, 1.0, 0.95)
    b, _ = gae(r[:, [1, 3, 4]], v[:, [1, 3, 4]], torch.ones(1, 3, dtype=torch.bool), 1.0, 0.95)
    assert torch.allclose(a[0, [1, 3, 4]], b[0], atol=1e-7) and a[0, 2] == 0


def test_value_loss_by_hand():
    """V = [0.6, 0.2, 0.3, 0.1], V_old = [0.5, 0.2, -0.1, 0.3], G = [0.3902944, 0.56152, 0.666, 0.85], eps_v 0.2.
    Token 2 moved 0.4 > 0.2: its clipped value is -0.1 + 0.2 = 0.1, (0.1 - 0.666)^2 = 0.320356 > (0.3 - 0.666)^2, so the
    clipped branch counts. Loss 0.5 x [0.04397644, 0.13069671, 0.320356, 0.5625], token mean 0.13219115."""
    V = torch.tensor([[0.6, 0.2, 0.3, 0.1]])
    old = torch.tensor([[0.5, 0.2, -0.1, 0.3]])
    G = torch.tensor([[0.3902944, 0.56152, 0.666, 0.85]])
    tok, clipped = value_loss_tokens(V, old, G, 0.2)
    assert torch.allclose(tok[0], 0.5 * torch.tensor([0.04397644, 0.13069671, 0.320356, 0.5625]), atol=1e-6)
    assert clipped.tolist() == [[False, False, True, False]]
    assert math.isclose(float(tok.mean()), 0.13219115, abs_tol=1e-6)
    plain, _ = value_loss_tokens(V, old, G, None)
    assert math.isclose(float(plain[0, 2]), 0.5 * 0.133956, abs_tol=1e-6)


def _batch(B=3, P=2, T=9, seed=0):
    """Random rows: P prompt tokens, then responses of varying length (right padding)."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(2, T - P + 1, (B,), generator=g)
    origin = torch.zeros((B, T), dtype=torch.uint8)
    for i in range(B):
        origin[i, :P] = CODE["prompt"]
        origin[i, P: P + int(lens[i])] = CODE["policy"]
    return TrajectoryBatch(tokens=torch.randint(0, 20, (B, T), generator=g), origin=origin,
                           behavior_logprobs=-torch.rand((B, T), generator=g) * 2, group=torch.arange(B),
                           control=torch.ones(B, dtype=torch.bool), rewards=torch.randn(B, generator=g),
                           initial_logprobs=-torch.rand((B, T), generator=g) * 2,
                           values=torch.randn((B, T), generator=g))


def test_ppo_advantages_and_policy_loss():
    """The objective end to end on a batch: A from the pure functions, returns kept on the batch, and the loss the
    clipped surrogate -min(rho A, clip(rho) A), token-mean; the gradient reaches only the loss tokens."""
    from composer.batch import PolicyView

    b = _batch()
    obj = Ppo(kl_coef=0.05, gamma=0.99, lambd=0.9)
    adv = obj.advantages(b)
    mask = b.mask(["policy"])
    kl = reward_kl(b.behavior_logprobs, b.initial_logprobs, "k1")
    a, g = gae(token_rewards(b.rewards, mask, kl, 0.05), b.values, mask, 0.99, 0.9)
    assert torch.equal(b.returns, g) and torch.allclose(adv, whiten(a, mask, "mean_std"))
    cur = (b.behavior_logprobs + 0.3 * torch.randn(b.tokens.shape, generator=torch.Generator().manual_seed(1)))
    cur.requires_grad_(True)
    loss, m = obj.loss(b, PolicyView(cur), adv)
    rho = torch.exp(cur.detach() - b.behavior_logprobs)
    want = -torch.minimum(rho * adv, rho.clamp(0.8, 1.2) * adv)[mask].mean()
    assert torch.allclose(loss, want, atol=1e-6) and m["clip_frac"] > 0
    loss.backward()
    assert (cur.grad[~mask] == 0).all() and (cur.grad[mask] != 0).any()


# --------------------------------------------------------------------------------------- OpenRLHF's own functions

@needs_openrlhf
@pytest.mark.parametrize("kl_estimator", ["k1", "k3"])
def test_gae_equals_openrlhf_on_a_random_batch(kl_estimator):
    """Our per-token rewards, GAE and whitening against OpenRLHF 0.11.2's compute_approx_kl, compute_reward,
    RemoteExperienceMaker.get_advantages_and_returns and the normalisation of compute_advantages_and_returns
    (estimator gae), called on the same batch: equal to float32 rounding. OpenRLHF's tensors are the response
    positions (prompts of one length here)."""
    ns = openrlhf_code("models/utils.py", ["compute_approx_kl", "compute_reward", "masked_mean"], _openrlhf_env())
    ns = openrlhf_code("trainer/ppo_utils/length_penalty.py", ["apply_overlong_penalty", "apply_stop_properly_penalty",
                                                              "apply_length_penalties"], ns)
    ns = openrlhf_code("trainer/ppo_utils/experience_maker.py", ["RemoteExperienceMaker.get_advantages_and_returns",
                                                                 "RemoteExperienceMaker.compute_advantages_and_returns"],
                       ns)
    B, P, T = 6, 3, 14
    b = _batch(B, P, T, seed=3)
    b.behavior_logprobs = b.initial_logprobs + 0.5 * torch.randn(b.tokens.shape, generator=torch.Generator().manual_seed(4))
    beta, gamma, lambd = 0.05, 0.97, 0.9
    obj = Ppo(kl_coef=beta, gamma=gamma, lambd=lambd, kl_estimator=kl_estimator)
    ours = obj.advantages(b)

    action_mask = b.mask(["policy"])[:, P:]
    args = types.SimpleNamespace(
        rollout=types.SimpleNamespace(n_samples_per_prompt=1, max_new_tokens=None),
        algo=types.SimpleNamespace(advantage=types.SimpleNamespace(estimator="gae", gamma=gamma, lambd=lambd,
                                                                   no_std_norm=False)),
        reward=types.SimpleNamespace(clip_range=(-1e10, 1e10), overlong_buffer_len=None, stop_properly_penalty_coef=None),
        data=types.SimpleNamespace(max_len=T))
    maker = types.SimpleNamespace(strategy=types.SimpleNamespace(args=args), advantage_estimator="gae",
                                  kl_ctl=types.SimpleNamespace(value=beta))
    maker.get_advantages_and_returns = types.MethodType(ns["RemoteExperienceMaker.get_advantages_and_returns"], maker)
    kl = ns["compute_approx_kl"](b.behavior_logprobs[:, P:], b.initial_logprobs[:, P:], kl_estimator=kl_estimator)
    exps = []
    for lo in range(0, B, 4):  # two micro-batches, as make_experience splits a step
        sl = slice(lo, min(lo + 4, B))
        exps.append(types.SimpleNamespace(rewards=b.rewards[sl].clone(), index=list(range(sl.start, sl.stop)),
                                          kl=kl[sl] * action_mask[sl], action_mask=action_mask[sl],
                                          values=b.values[sl, P:] * action_mask[sl], info={}))
    exps = ns["RemoteExperienceMaker.compute_advantages_and_returns"](maker, exps)
    theirs_adv = torch.cat([e.advantages for e in exps]) * action_mask
    theirs_ret = torch.cat([e.returns for e in exps]) * action_mask
    assert torch.allclose(ours[:, P:], theirs_adv, atol=1e-5), (ours[:, P:] - theirs_adv).abs().max()
    assert torch.allclose(b.returns[:, P:], theirs_ret, atol=1e-5)
    assert theirs_adv.abs().sum() > 1  # not a comparison of zeros


@needs_openrlhf
def test_value_loss_equals_openrlhf():
    """critic_loss (the clipped value loss, token mean) against OpenRLHF's ValueLoss(value_clip) on one batch."""
    ns = openrlhf_code("models/utils.py", ["masked_mean"], _openrlhf_env())
    ns = openrlhf_code("models/loss.py", ["aggregate_loss", "ValueLoss"], ns)
    b = _batch(5, 2, 12, seed=7)
    obj = Ppo(critic={"value_clip": 0.2})
    obj.advantages(b)
    g = torch.Generator().manual_seed(8)
    values = b.values + 0.4 * torch.randn(b.tokens.shape, generator=g)
    ours, m = obj.critic_loss(b, values)
    mask = b.mask(["policy"])
    theirs = ns["ValueLoss"](0.2)(values[:, 2:], b.values[:, 2:], b.returns[:, 2:], action_mask=mask[:, 2:])
    assert torch.allclose(ours, theirs, atol=1e-6) and m["critic/clip_frac"] > 0
    ours_plain, _ = Ppo(critic={"value_clip": None}).critic_loss(b, values)
    assert torch.allclose(ours_plain, ns["ValueLoss"](None)(values[:, 2:], b.values[:, 2:], b.returns[:, 2:],
                                                            action_mask=mask[:, 2:]), atol=1e-6)


def test_gae_equals_trl_ppo_loop():
    """TRL's PPOTrainer GAE (trl/trainer/ppo_trainer.py, `train`: the reversed loop over the response with
    nextvalues 0 past the end, on rewards already holding -kl_coef * kl and the score at the last token), written
    out here as TRL writes it, on the same per-token rewards and values: equal."""
    b = _batch(4, 2, 11, seed=11)
    mask = b.mask(["policy"])
    r = token_rewards(b.rewards, mask, None, 0.0)
    ours, _ = gae(r, b.values, mask, 1.0, 0.95)
    # TRL: values and rewards on the response (padding 0), lastgaelam over reversed(range(gen_length))
    rew, val = (r * mask)[:, 2:], (b.values * mask)[:, 2:]
    lastgaelam, rev = 0, []
    gen_length = rew.shape[1]
    for t in reversed(range(gen_length)):
        nextvalues = val[:, t + 1] if t < gen_length - 1 else 0.0
        delta = rew[:, t] + 1.0 * nextvalues - val[:, t]
        lastgaelam = delta + 1.0 * 0.95 * lastgaelam
        rev.append(lastgaelam)
    trl = torch.stack(rev[::-1], axis=1) * mask[:, 2:]
    assert torch.allclose(ours[:, 2:], trl, atol=1e-6)


# --------------------------------------------------------------------------------------- the reward-model source

CORPUS = ["Q:2+3-4\nA:", "2+3=5\n5-4=1\n#1", "Rate this answer from a tutor.", "the final answer is", "#7\n#3",
          "user assistant system", "0123456789+-=#:QA\n"] * 20
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def bpe_reward_model(tmp_path_factory) -> str:
    """A real-format HF reward model: a tiny random Qwen3ForSequenceClassification (one output, head `score`) with a
    byte-level BPE tokenizer and a chat template, both unlike the toy policy's char tokenizer (no template)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForSequenceClassification

    out = tmp_path_factory.mktemp("bpe_rm")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=320, special_tokens=["<|pad|>", "<|im_start|>",
                                                                                         "<|im_end|>"],
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<|pad|>", eos_token="<|im_end|>")
    fast.chat_template = TEMPLATE
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=len(fast), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=16, num_labels=1,
                      pad_token_id=fast.pad_token_id, max_position_embeddings=256)
    model = Qwen3ForSequenceClassification(cfg)
    torch.nn.init.normal_(model.score.weight, std=0.5)  # scores far from 0, so a wrong position shows
    model.save_pretrained(out)
    fast.save_pretrained(out)
    return str(out)


def _rm_ctx(model_path: str, source_cfg: dict):
    """A run context on the toy policy (char tokenizer) with one reward_model source, and a batch of 4 toy rollouts."""
    import random

    from components.sources.reward_model import RewardModel
    from composer.checks.validate import validate_file  # noqa: F401  (registers every kind)
    from composer.lang.spec import spec_model
    from composer.protocol import Piece, Trace
    from composer.registry import part
    from composer.runtime.context import RunContext
    from composer.runtime.models import load_model, load_tokenizer
    from composer.trajectory import assemble

    tok = load_tokenizer("toy:student")
    policy = load_model("toy:student")
    spec = spec_model()(name="t", sources={"rm": {"kind": "reward_model", "model": model_path, **source_cfg}},
                        signal={"kind": "reward", "source": "rm"}, objective={"kind": "ppo"})
    task = part("toy.task")()
    ctx = RunContext(task=task, tokenizer=tok, policy=policy, engine=None, spec=spec, rng=random.Random(0))
    examples = task.train[:4]
    responses = ["2+3=5\n#5", "1-4=7\n7+2=9\n#9", "#3", "9+9=8\n"]
    traces = [Trace(prompt=tok.encode(ex.prompt), pieces=[Piece(tok.encode(r) + [tok.eos_token_id], "policy", [0.0] * (len(r) + 1))])
              for ex, r in zip(examples, responses)]
    batch = assemble(traces, examples, list(range(4)), tok.pad_token_id)
    return ctx, batch, RewardModel(model=model_path, **source_cfg), responses, examples


def test_reward_model_scores_retokenised_text_at_the_last_token(bpe_reward_model):
    """input: text: the reward model reads the policy's user message and the response rendered with ITS chat template
    and tokenised by ITS byte-level BPE tokenizer (the policy's is a char tokenizer): the scores equal the HF
    checkpoint's own forward (Qwen3ForSequenceClassification pools the last non-padding token) on that text, one row
    at a time (no padding) and batched; the rows' token ids are not the policy's."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    ctx, batch, cfg, responses, examples = _rm_ctx(bpe_reward_model, {})
    cfg.preflight(ctx, "rm")  # another vocabulary is fine with input: text
    scorer = cfg.build(ctx, "rm")
    got = scorer.rewards(ctx, batch)
    hf = AutoModelForSequenceClassification.from_pretrained(bpe_reward_model).eval()
    tok = AutoTokenizer.from_pretrained(bpe_reward_model)
    texts = [tok.apply_chat_template([{"role": "user", "content": ex.prompt}, {"role": "assistant", "content": r}],
                                     tokenize=False) for ex, r in zip(examples, responses)]
    assert texts[0].startswith("<|im_start|>user\nQ:") and texts[0].endswith("<|im_end|>\n")
    ids = [tok.encode(t, add_special_tokens=False) for t in texts]
    assert scorer.inputs(ctx, batch) == ids and ids[0] != batch.tokens[0][batch.attention_mask[0]].tolist()
    with torch.no_grad():
        one = torch.tensor([float(hf(input_ids=torch.tensor([x])).logits[0, 0]) for x in ids])
        padded = tok(texts, add_special_tokens=False, padding=True, return_tensors="pt")
        many = hf(**padded).logits[:, 0]
    assert torch.allclose(got, one, atol=1e-5) and torch.allclose(got, many, atol=1e-5)
    assert float(got.std()) > 1e-3  # rows differ: not one position read for all


def test_reward_model_tokens_input_needs_the_policy_vocabulary(bpe_reward_model):
    """input: tokens scores the policy's ids: another tokenizer is refused before training, naming the fix."""
    from composer.errors import ModelLoadError

    ctx, _batch, cfg, _r, _e = _rm_ctx(bpe_reward_model, {"input": "tokens"})
    with pytest.raises(ModelLoadError, match="use input: text"):
        cfg.preflight(ctx, "rm")


def test_reward_model_normalisation(bpe_reward_model, tmp_path):
    """normalize: config: (r - mean) / std of the checkpoint's config.json; running: Welford over every score so far,
    this batch's included (a second batch is normalised by the statistics of both)."""
    import shutil

    ctx, batch, cfg, _r, _e = _rm_ctx(bpe_reward_model, {})
    raw = cfg.build(ctx, "rm").raw_scores(ctx, batch).double()
    path = tmp_path / "rm"
    shutil.copytree(bpe_reward_model, path)
    conf = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**conf, "mean": 0.25, "std": 2.0}))
    ctx2, batch2, cfg2, _r, _e = _rm_ctx(str(path), {"normalize": "config"})
    assert torch.allclose(cfg2.build(ctx2, "rm").rewards(ctx2, batch2).double(), (raw - 0.25) / 2.0, atol=1e-5)
    ctx3, batch3, cfg3, _r, _e = _rm_ctx(bpe_reward_model, {"normalize": "running"})
    sc = cfg3.build(ctx3, "rm")
    first = sc.rewards(ctx3, batch3).double()
    assert torch.allclose(first, (raw - raw.mean()) / raw.std(unbiased=False), atol=1e-5)
    second = sc.rewards(ctx3, batch3.select([0, 1])).double()
    both = torch.cat([raw, raw[:2]])
    assert torch.allclose(second, (raw[:2] - both.mean()) / both.std(unbiased=False), atol=1e-5)
    state = sc.state_dict()
    sc2 = cfg3.build(ctx3, "rm")
    sc2.load_state_dict(state)  # a resumed run continues the statistics
    assert (sc2.count, sc2.mean, sc2.m2) == (6, state["mean"], state["m2"])


@needs_openrlhf
def test_reward_model_score_equals_openrlhf(bpe_reward_model):
    """OpenRLHF 0.11.2's reward model class (models/model.py `_get_reward_model` over Qwen3Model, value head `score`)
    loaded from the same checkpoint, on the ids our source built, right-padded: the same score at the last token."""
    from transformers import AutoConfig
    from transformers.models.qwen3.modeling_qwen3 import Qwen3Model, Qwen3PreTrainedModel

    ns = openrlhf_code("models/model.py", ["_get_reward_model"], {**_openrlhf_env(), "AutoConfig": AutoConfig})
    RM = ns["_get_reward_model"](Qwen3PreTrainedModel, Qwen3Model, "score", False)
    config = AutoConfig.from_pretrained(bpe_reward_model)
    config.normalize_reward = False
    theirs = RM.from_pretrained(bpe_reward_model, config=config).eval()
    ctx, batch, cfg, _r, _e = _rm_ctx(bpe_reward_model, {})
    scorer = cfg.build(ctx, "rm")
    ids = scorer.inputs(ctx, batch)
    T = max(len(x) for x in ids)
    tok = torch.zeros((len(ids), T), dtype=torch.long)
    mask = torch.zeros((len(ids), T), dtype=torch.long)
    for i, x in enumerate(ids):
        tok[i, : len(x)], mask[i, : len(x)] = torch.tensor(x), 1
    with torch.no_grad():
        want = theirs(tok, attention_mask=mask)
    assert torch.allclose(scorer.raw_scores(ctx, batch), want.float(), atol=1e-5)


# --------------------------------------------------------------------------------------- runs

@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    from components.tasks.bootstrap import tiny_random_checkpoint

    return tiny_random_checkpoint(str(tmp_path_factory.mktemp("tiny")))


def _rows(path: Path) -> list[dict]:
    import csv

    with open(path / "metrics.csv", newline="") as f:
        return [r for r in csv.DictReader(f) if r.get("loss")]


def test_resume_of_a_ppo_run_is_exact(tiny, tmp_path):
    """A PPO run stopped after step 2 and resumed continues as the uninterrupted one, critic included: the same losses,
    value losses and values at steps 3-4, and the same policy and critic (weights, AdamW state, update count) at the
    end. The critic's state lives in the checkpoint's composer state (`runtimes`)."""
    from composer.runtime import checkpoint as ckpt_format
    from composer.backends.lightning.run import train
    from composer.checks.validate import validate_file

    over = [f"policy.model={tiny}", "train.prompts_per_step=2", "rollout.samples_per_prompt=2",
            "rollout.max_new_tokens=12", "train.eval_every=0", "train.eval_samples=2", "train.checkpoint_every=2",
            "train.samples_every=0", "objective.kl_coef=0.05"]
    spec = ROOT / "specs" / "methods" / "ppo.yaml"
    train(validate_file(spec, over + ["train.steps=4"]), tmp_path / "ref", progress=False)
    train(validate_file(spec, over + ["train.steps=2"]), tmp_path / "cut", progress=False)
    train(validate_file(spec, over + ["train.steps=4"]), tmp_path / "cut", resume=True, progress=False)
    want, got = _rows(tmp_path / "ref"), _rows(tmp_path / "cut")
    assert [r["step"] for r in got] == [r["step"] for r in want] == ["0", "1", "2", "3"]
    for a, b in zip(want, got):
        for key in ("loss", "critic/loss", "critic/first_loss", "values_mean", "returns_mean", "reward_kl"):
            assert a[key] == b[key], (a["step"], key, a[key], b[key])
    wa, wb = (ckpt_format.load(d / "checkpoints" / "last.ckpt") for d in (tmp_path / "ref", tmp_path / "cut"))
    assert all(torch.equal(wa["state_dict"][k], wb["state_dict"][k]) for k in wa["state_dict"])
    ca, cb = (next(v for k, v in w["composer"]["runtimes"].items() if "critic" in k) for w in (wa, wb))
    assert ca["updates"] == cb["updates"] == 8  # 4 steps x 2 epochs
    assert all(torch.equal(ca["weights"][k], cb["weights"][k]) for k in ca["weights"])
    sa, sb = ca["optimizer"]["state"], cb["optimizer"]["state"]
    assert sa.keys() == sb.keys() and all(torch.equal(sa[i]["exp_avg_sq"], sb[i]["exp_avg_sq"]) for i in sa)
    start = _rows(tmp_path / "ref")[0]
    assert float(start["critic/loss"]) != float(want[-1]["critic/loss"])  # the critic trained


# --------------------------------------------------------------------------------------- OpenRLHF bundles

@pytest.fixture(scope="module")
def char_reward_model(tmp_path_factory) -> str:
    """A tiny random reward model on the toy policy's char tokenizer (what OpenRLHF's reward model can read)."""
    from transformers import Qwen3Config, Qwen3ForSequenceClassification

    from components.tasks.tokenizer import char_tokenizer

    out = tmp_path_factory.mktemp("char_rm")
    tok = char_tokenizer()
    torch.manual_seed(1)
    cfg = Qwen3Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=16, num_labels=1,
                      pad_token_id=tok.pad_token_id, max_position_embeddings=512)
    Qwen3ForSequenceClassification(cfg).save_pretrained(out)
    tok.save_pretrained(out)
    return str(out)


def _compile(tmp_path, spec: str, overrides: list[str]):
    from composer.backends.openrlhf.bundle import compile_bundle
    from composer.backends.openrlhf.flags import Layout
    from composer.checks.validate import validate_file

    v = validate_file(ROOT / spec, overrides)
    out = tmp_path / "bundle"
    compile_bundle(v, out, Layout(nodes=1, gpus_per_node=2, cluster_dir=str(tmp_path / "cluster")))
    return out, json.loads((out / "args.json").read_text())["main"]


def _flag(argv: list[str], name: str) -> list[str]:
    i = argv.index(f"--{name}")
    out = []
    for x in argv[i + 1:]:
        if x.startswith("--") and not x[2:3].isdigit():
            break
        out.append(x)
    return out


@needs_openrlhf
def test_ppo_compiles_to_openrlhfs_own_critic(tiny, tmp_path):
    """ppo.yaml on OpenRLHF: its critic (from the policy's checkpoint, on the actor's GPUs), GAE with the spec's gamma
    and lambda, ValueLoss's clip, the critic's AdamW, the KL in the reward, PolicyLoss; no composer loss plugin."""
    bundle, argv = _compile(tmp_path, "specs/methods/ppo.yaml", [f"policy.model={tiny}", "train.steps=2"])
    assert _flag(argv, "algo.advantage.estimator") == ["gae"]
    assert _flag(argv, "algo.advantage.gamma") == ["1.0"] and _flag(argv, "algo.advantage.lambd") == ["0.95"]
    assert _flag(argv, "critic.model_name_or_path") == _flag(argv, "actor.model_name_or_path")
    assert _flag(argv, "critic.value_clip") == ["0.2"] and _flag(argv, "critic.adam.lr") == ["0.0005"]
    assert _flag(argv, "critic.num_gpus_per_node") == _flag(argv, "actor.num_gpus_per_node")
    assert _flag(argv, "algo.kl.init_coef") == ["0.01"] and "--algo.kl.use_loss" not in argv
    assert _flag(argv, "actor.policy_loss_type") == ["ppo"] and _flag(argv, "train.max_epochs") == ["2"]
    plan = json.loads((bundle / "plan.json").read_text())
    assert plan["openrlhf"]["runs"][0]["plugin"]["loss"] is False
    assert any(m["role"] == "critic:term0" and m["trainable"] for m in plan["segments"][0]["models"])


@needs_openrlhf
def test_a_reward_model_compiles_to_openrlhfs_reward_model(tiny, char_reward_model, tmp_path):
    """ppo-rm.yaml on OpenRLHF with a reward model of the policy's vocabulary: --reward.model_name_or_path on the
    actor's GPUs, no reward function, no evaluation during the run (OpenRLHF's needs a reward function)."""
    bundle, argv = _compile(tmp_path, "specs/methods/ppo-rm.yaml", [f"policy.model={tiny}",
                                                                    f"sources.rm.model={char_reward_model}"])
    assert _flag(argv, "reward.model_name_or_path") == [char_reward_model]
    assert "--reward.remote_url" not in argv and "--eval.dataset" not in argv and not (bundle / "reward.py").exists()
    assert "evaluate the exported model" in (bundle / "README.md").read_text()


@needs_openrlhf
@pytest.mark.parametrize("overrides,path,reason", [
    (["objective.critic.network=shared"], "objective.critic.network", "no head on the actor's network"),
    (["objective.critic.value_clip=null"], "objective.critic.value_clip", "cannot be switched off"),
    (["objective.whiten=none"], "objective.whiten", "normalises GAE advantages"),
    (["sources.rm.input=text"], "sources.rm.input", "cannot re-tokenise"),
    (["sources.rm.normalize=running"], "sources.rm.normalize", "not by running statistics"),
])
def test_what_openrlhf_cannot_do_with_a_critic_is_refused(tiny, char_reward_model, tmp_path, overrides, path, reason):
    from composer.backends.openrlhf.flags import Unsupported

    with pytest.raises(Unsupported) as e:
        _compile(tmp_path, "specs/methods/ppo-rm.yaml", [f"policy.model={tiny}", f"sources.rm.model={char_reward_model}",
                                                        *overrides])
    assert ".".join(map(str, e.value.path)) == path and reason in e.value.reason


@needs_openrlhf
def test_a_reward_model_of_another_vocabulary_is_refused_on_openrlhf(tiny, bpe_reward_model, tmp_path):
    from composer.backends.openrlhf.flags import Unsupported

    with pytest.raises(Unsupported, match="scores the policy's token ids") as e:
        _compile(tmp_path, "specs/methods/ppo-rm.yaml", [f"policy.model={tiny}", f"sources.rm.model={bpe_reward_model}"])
    assert e.value.path == ("sources", "rm", "model")


# --------------------------------------------------------------------------------------- toy:reward

def test_toy_reward_is_built_only_when_named(tmp_path, monkeypatch):
    """The default cache key (toy-v2) and what a run that never names toy:reward waits for do not change: with the
    student, the teacher and the tokenizer in the cache, ensure_checkpoints() returns at once and builds nothing;
    resolving `toy:reward` asks for it (reward=True)."""
    from components.tasks import bootstrap
    from composer.runtime import models

    for d in ("tokenizer", "student", "teacher"):
        (tmp_path / d).mkdir()
    monkeypatch.setattr(bootstrap, "train_reward", lambda *a: pytest.fail("toy:reward built without being named"))
    paths = bootstrap.ensure_checkpoints(str(tmp_path))
    assert paths["reward"] == str(tmp_path / bootstrap.REWARD_DIR) and not (tmp_path / bootstrap.REWARD_DIR).exists()
    assert bootstrap.cache_key() == "toy-v2"
    asked = []
    monkeypatch.setattr("composer.registry.part", lambda name: (lambda **kw: asked.append(kw) or paths))
    assert models.resolve("toy:reward") == paths["reward"] and asked == [{"reward": True}]
    assert models.resolve("toy:student") == paths["student"] and asked[-1] == {}


@pytest.mark.slow
def test_a_critic_head_on_the_policy_passes_the_referee(tmp_path):
    """ppo.yaml with critic.network: shared (a scalar head on the policy's network, the value loss inside the policy's
    loss times value_coef): the referee recomputes its old values from the policy's recorded weights and the head's,
    GAE, and each loss with the value part from a fresh forward of the weights and head of that update."""
    from composer.referee import referee

    rep = referee(ROOT / "specs" / "methods" / "ppo.yaml", tmp_path, ["objective.critic.network=shared"])
    assert rep.ok, "\n".join(rep.failures()) + "\n" + rep.table()
    assert rep.checks["policy loss recomputed (critic)"].passed > 0 and rep.checks["critic moved"].passed > 0
