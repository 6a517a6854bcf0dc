"""The referee's recorder: a short run of a spec with RunContext.record installed, keeping only inputs.

What it keeps (DESIGN.md section 10): every rollout batch as the sampler wrote it, with a fresh forward of the
rollout weights at the spec's declared sampling temperature; the verifier's verdicts per row (as it returned
them, keyed by the row's tokens); the trained weights before every step's update and after the run; at each
term's loss, autograd's gradient of that loss w.r.t. the policy's log-probs and a fresh forward of the live
weights at the temperature the spec declares for that term. Nothing the run computed from these (gate rows,
control flags, filter output, advantages, references) is trusted: composer/referee/checks.py recomputes them.
"""

from __future__ import annotations

import copy
import hashlib
from pathlib import Path

import yaml

from composer.origins import CODE, ORIGINS

# Hot enough to test the numbers: 4 prompts per step and 32 new tokens (the toy's 2- and 4-step chains fit, so
# groups mix and the weights move); the referee fails if they did not.
FAST = ["train.prompts_per_step=4", "rollout.max_new_tokens=32", "train.eval_every=0", "train.eval_samples=2",
        "train.checkpoint_every=1000"]
# The toy student solves the chains it was trained on (1-4 steps) nearly always: groups there may never mix. On
# 6-step chains it errs in most samples and gets some right, on any bootstrap (48 new tokens fit them). It writes at
# most 4 steps (27 tokens), so 3-step chains beside them (21 tokens) give rows of different lengths: an aggregation
# (token-mean, seq-mean, ...) is told apart.
HARD = ["data.train_tiers=[3,6]", "rollout.max_new_tokens=48"]
# specs with their own tiers (InT: its stages need targets and a GRPO stage that moves the weights; 8 prompts a
# step over its 3 short steps give its stage 1 about 20 failed attempts, and 48 tokens fit its 6-step chains;
# SRPO: its distillation term trains failed rows with a successful sibling, and its EMA teacher must be seen after
# it moved: 8 prompts a step give such rows at more than the first step)
HOT: dict[str, list[str]] = {"int": ["train.prompts_per_step=8", "rollout.max_new_tokens=48"],
                             "srpo": [*HARD, "train.prompts_per_step=8"],
                             # POPE after SFT guides the prompts its rollouts fail: 6-step chains only
                             "pope-sft": ["data.train_tiers=[6]", "rollout.max_new_tokens=48"],
                             # HPT: SFT on the prompts no rollout solves (5- and 6-step references: two lengths),
                             # GRPO on the others (2-step chains, and 5-6 with a success), its clip reached at 3e-4
                             "hpt": ["data.train_tiers=[2,5,6]", "rollout.max_new_tokens=48",
                                     "train.prompts_per_step=8", "train.lr=3e-4"],
                             # VAPO: its NLL term trains only correct rollouts: 4-step chains beside the 6-step ones
                             "vapo": ["data.train_tiers=[4,6]", "rollout.max_new_tokens=48", "train.prompts_per_step=8"]}
GUIDE_ORIGINS = ("guide_prefix", "guide_intervention", "demonstration")  # tokens a guide wrote (the traces guide:
# demonstration)
TOL = 2e-3  # float32 forward passes of different shapes (KV cache vs one pass)
# a sampler computing in bfloat16 (vLLM at rollout.precision: bf16) against the same bf16 weights run by transformers
# on CPU: different kernels and accumulation orders, so per-token log-probs agree to bf16 noise only; measured on the
# toy (vLLM 0.32 CPU build, specs/methods/grpo-tis.yaml rollout.engine=vllm): mean 0.002-0.005, max 0.19-0.26 nats
# per step. The bounds below leave about 6x and 2x room; the check is weaker than float32's TOL, and says so.
BF16_MEAN, BF16_MAX = 0.03, 0.6


def short(path: Path, extra=()) -> list[str]:
    """Overrides that run every segment of the spec for 2-3 steps and sync within the run (toy tiers for a
    spec on the toy testbed)."""
    from composer.checks.validate import validate_file

    data = yaml.safe_load(Path(path).read_text()) or {}
    v = validate_file(path, list(extra))
    out = list(FAST)
    if data.get("stages"):
        out += [f"stages.{i}.train.steps=3" for i in range(len(data["stages"]))]
    elif data.get("phases"):
        out += [f"train.steps={2 * len(data['phases'])}"]
        out += [f"phases.{i}.until={2 * (i + 1)}" for i in range(len(data["phases"]))]
    else:
        out += ["train.steps=3"]
    if all(s.spec.data.train is None for s in v.segments):  # the toy testbed
        out += HOT.get(Path(path).stem, HARD)
        for o in dict.fromkeys(o for s in v.segments for src in s.spec.sources.values()
                               for o in src.short_run_overrides()):  # what a part needs to act in a short run
            out += [o]
        for o in dict.fromkeys(o for s in v.segments for o in s.spec.rollout.environment.short_run_overrides()):
            out += [o]  # an environment's (room for a tool call in the short run's responses)
    # a part that acts only with more updates per step (a stage's or a phase's too, through the base train section)
    from composer.checks.terms import terms

    staged = bool(data.get("stages")) and len(v.segments) == len(data["stages"])
    more = list(dict.fromkeys((i, tuple(obj.short_run_overrides(s.spec))) for i, s in enumerate(v.segments)
                              for _n, _s, obj, _w in terms(s.spec) if obj is not None))
    from composer.errors import SpecError

    for i, group in more:  # a part's overrides together, where the spec takes them: the stage's own section, else
        if not group:      # the run's (train.epochs is the whole run's); a term without a ratio refuses a second
            continue       # pass, and a bound of a term beside it then "cannot act in this run" (the coverage)
        for form in ([[f"stages.{i}.{o}" for o in group]] if staged else []) + [list(group)]:
            try:
                validate_file(path, out + form + list(extra))
                out += form
                break
            except SpecError:
                pass
    if any(s.spec.sync.every > 2 for s in v.segments) and not data.get("stages"):
        out += ["sync.every=2"]
    if (data.get("train") or {}).get("reset_every") and not data.get("stages"):  # a periodic reset inside the run
        out += ["train.reset_every=2"]
    return out + list(extra)


def fingerprint(model_or_state) -> str:
    """A digest of every parameter's bytes (two models with equal weights give the same string)."""
    h = hashlib.sha1()
    items = model_or_state.values() if isinstance(model_or_state, dict) else model_or_state.parameters()
    for p in items:
        h.update(p.detach().float().cpu().numpy().tobytes())
    return h.hexdigest()


def fresh_logprobs(model, tokens, attention_mask, temperature: float):
    """[B, T] log p(tokens[b, t] | tokens[b, :t]) by one forward pass of `model` at `temperature` (0 at t = 0)."""
    import torch

    dev = next(model.parameters()).device
    with torch.no_grad():
        logits = model(input_ids=tokens.to(dev), attention_mask=attention_mask.long().to(dev)).logits
    lp = torch.log_softmax(logits.float() / temperature, -1)
    out = torch.zeros(tokens.shape)
    out[:, 1:] = lp[:, :-1].gather(-1, tokens[:, 1:, None].to(dev)).squeeze(-1).cpu()
    return out


def fresh_entropy(model, tokens, attention_mask, temperature: float):
    """[B, T] the entropy -sum_v p log p of `model`'s next-token distribution predicting tokens[b, t], by one forward
    pass at `temperature` (0 at t = 0), in float64 from the float32 logits."""
    import torch

    dev = next(model.parameters()).device
    with torch.no_grad():
        logits = model(input_ids=tokens.to(dev), attention_mask=attention_mask.long().to(dev)).logits
    lp = torch.log_softmax(logits.double() / temperature, -1)
    out = torch.zeros(tokens.shape, dtype=torch.float64)
    out[:, 1:] = -(lp.exp() * lp).sum(-1)[:, :-1].cpu()
    return out


def row_key(batch, i: int) -> tuple:
    """Row i's tokens (padding off): how a row is found again in another batch (filters concatenate rows)."""
    return tuple(batch.tokens[i][batch.attention_mask[i].bool()].tolist())


def segment_spec(v, name: str):
    return next(s.spec for s in v.segments if s.name == name)


def declared_loss_temperature(spec, term: str) -> float:
    """The temperature the spec declares for term `term`'s log-probs: its signal's own (SFT's `temperature`),
    else the rollout's sampling temperature."""
    from composer.checks.terms import terms

    for n, sig, _o, _w in terms(spec):
        t = getattr(sig, "loss_temperature", None) if n == term and sig is not None else None
        if t is not None:
            return float(t)
    return float(spec.rollout.temperature)


class Recorder:
    """RunContext.record's recorder: events of what ran, and the inputs the referee recomputes from."""

    def __init__(self, v):
        self.v = v
        self.events: list[tuple[str, dict]] = []
        self.logprob_errors: list[tuple] = []
        self.temperature_errors: list[tuple] = []  # (step, term, declared T, max |run - fresh|)
        self.policy_at: dict[int, str] = {}  # step -> fingerprint of the trained weights before that step's update
        self.bf16_errors: list[tuple] = []  # (step, mean, max, n) of a bf16 sampler's behaviour log-probs
        self.policy_bf16_at: dict[int, str] = {}  # step -> the same weights rounded to bfloat16 (a bf16 sampler's)
        self.rollout_at: dict[int, str] = {}  # step -> the weights that sampled that step's rollouts
        self.weights_at: dict[int, dict] = {}  # step -> a copy of the trained weights before that step's update
        self.final: dict | None = None  # the trained weights after the run
        self.sampler_lp: dict[int, object] = {}  # id(rollout tokens) -> the sampler's fresh log-probs
        self.keep: list = []  # the rollout tensors whose ids key sampler_lp (kept alive)
        self.scratch = None  # a copy of the policy's architecture: fresh forwards of recorded weights
        self.policy = None  # the live policy module
        self.sampled: set[tuple] = set()
        self.budgets: set[int] = set()  # max_tokens of the rollout weights' sample requests of the current rollout
        self.written: list[tuple] = []  # (model, prompt tokens, continuation), in order, of every generation a source wrote
        self.not_sampled: list[tuple] = []
        self.policy_tokens_checked = 0
        self.tokenizer = None
        self.verdicts: dict[tuple, tuple] = {}  # (verifier, row tokens) -> (reward, parsed)
        self.verdict_log: list[tuple] = []  # (step, segment, verifier, parsed)
        self.verified: list[tuple] = []  # (step, source config, the task's verifier, row tokens, origins, example,
        #                                  (reward, parsed) as the run returned them): re-verified by the referee
        self.critic_scratch: dict = {}  # term -> a copy of its critic's network (own) or head (shared)
        self.updates = None  # composer/referee/optim.py's UpdateWatch on the run's optimiser
        self.judged: dict[tuple, bool] = {}  # (problem, text) -> the verifier's success, for texts a guide judged

    def _keep_weights(self, step: int, policy) -> None:
        import torch

        if policy is None or step in self.weights_at:
            return
        self.policy = policy
        self.policy_at[step] = fingerprint(policy)
        # the same weights as a bf16 sampler holds them (rollout.precision: bf16): each parameter rounded to bfloat16
        self.policy_bf16_at[step] = fingerprint({k: p.detach().to(torch.bfloat16) for k, p in policy.named_parameters()})
        self.weights_at[step] = {k: t.detach().clone() for k, t in policy.state_dict().items()}
        if self.scratch is None:
            self.scratch = copy.deepcopy(policy).eval().requires_grad_(False)

    def __call__(self, kind, **data):
        if kind == "rollout":  # check now: the rollout weights are the ones that sampled this batch
            self._keep_weights(data["step"], data["policy"])
            self.tokenizer = self.tokenizer or data["engine"].tok
            self.check_behaviour(data["batch"], data["engine"], data["step"], data["segment"])
            data["room"] = max(self.budgets) if self.budgets else None  # the response budget the rollouts got
            self.budgets = set()
            self.check_sampled(data["batch"], data["step"])
            self.rollout_at.setdefault(data["step"], fingerprint(data["engine"].model))
        if kind in ("critic_values", "critic_update", "critic_head", "critic_grads", "critic_stepped"):  # a critic's
            # weights as they were, its loss, the gradient its optimizer step read
            self.keep_critic(kind, data)
        if kind == "term_loss":  # now, before backward frees the graph and the optimiser moves the weights
            self._keep_weights(data["step"], data.get("policy"))
            data["grad_origins"], data["grad"] = self.grad_origins(data["loss"], data["view"], data["batch"])
            data["fresh"], data["temperature"] = self.fresh_view(data)
            data["loss_value"] = float(data["loss"].detach())
        self.events.append((kind, {k: x for k, x in data.items() if k not in ("policy", "loss", "critic")}))

    def keep_critic(self, kind: str, data: dict) -> None:
        """A critic's recorded inputs: a copy of its weights (own network: the network; shared: the head, and the
        policy's weights it reads), a scratch copy of its architecture (once), and at an update autograd's gradient
        of the value loss w.r.t. the values and the loss's value."""
        import torch

        rt = data["critic"]
        own = rt.net_or_head
        data["network"] = "own" if rt.separate else "shared"
        if kind == "critic_grads":
            data["grads"] = {n: (p.grad if p.grad is not None else torch.zeros_like(p)).detach().clone()
                             for n, p in own.named_parameters()}
            return
        data["state"] = {k: t.detach().clone() for k, t in own.state_dict().items()}
        if data["term"] not in self.critic_scratch:
            self.critic_scratch[data["term"]] = copy.deepcopy(own).eval().requires_grad_(False)
        if data.get("policy") is not None:
            data["policy_state"] = {k: t.detach().clone() for k, t in data["policy"].state_dict().items()}
            if self.scratch is None:
                self.scratch = copy.deepcopy(data["policy"]).eval().requires_grad_(False)
        if "values" in data:
            v = data["values"]
            if kind == "critic_update":
                (g,) = torch.autograd.grad(data["loss"], v, retain_graph=True, allow_unused=True)
                data["values_grad"] = None if g is None else g.detach().cpu()
                data["loss_value"] = float(data["loss"].detach())
            data["values"] = v.detach().cpu()

    def fresh_view(self, data):
        """The live weights' log-probs of the term's batch at the temperature the spec declares for the term
        (a fresh forward, not the run's)."""
        policy = data.get("policy")
        if policy is None:
            return None, None
        spec = segment_spec(self.v, data["segment"])
        temp = declared_loss_temperature(spec, data["term"])
        self.scratch.load_state_dict(policy.state_dict())
        b = data["batch"]
        return fresh_logprobs(self.scratch, b.tokens.cpu(), b.attention_mask.cpu(), temp), temp

    def on_sample(self, requests, answers) -> None:
        """The rollout weights' sampled continuations (served by the run's driver): every prefix they extend."""
        for req, gens in zip(requests, answers):
            self.budgets.add(req.max_tokens)
            for g in gens:
                seq = tuple(req.tokens) + tuple(g.tokens)
                self.sampled.update(seq[: t + 1] for t in range(len(req.tokens), len(seq)))

    def on_write(self, model: str, requests, answers) -> None:
        """What a source model (a teacher writing traces) generated after which tokens, as its server returned it."""
        for req, gens in zip(requests, answers):
            self.written.extend((model, tuple(req.tokens), tuple(g.tokens)) for g in gens)

    def on_verdicts(self, verifier: str, step: int, segment: str, batch, verdicts, cfg=None,
                    task_verifier: str | None = None) -> None:
        for i, vd in enumerate(verdicts):
            key = (verifier, row_key(batch, i))
            if key not in self.verdicts:
                self.verdict_log.append((step, segment, verifier, bool(vd.parsed)))
                if cfg is not None:  # the row as the batch holds it (tokens, origins, its example), not its text
                    keep = batch.attention_mask[i].bool()
                    self.verified.append((step, cfg, task_verifier, batch.tokens[i][keep].tolist(),
                                          batch.origin[i][keep].tolist(), batch.examples[i],
                                          (float(vd.reward), bool(vd.parsed))))
            self.verdicts[key] = (float(vd.reward), bool(vd.parsed))

    def check_sampled(self, batch, step):
        """Every token labelled `policy` was sampled by the rollout weights right after exactly the tokens
        before it in its row (so reference, prefix or judge text relabelled `policy` is caught)."""
        n_tok = batch.attention_mask.sum(1).tolist()
        for b in range(batch.size):
            row = tuple(batch.tokens[b, : n_tok[b]].tolist())
            for t in (batch.origin[b, : n_tok[b]] == CODE["policy"]).nonzero().flatten().tolist():
                self.policy_tokens_checked += 1
                if row[: t + 1] not in self.sampled:
                    self.not_sampled.append((step, b, t))
        self.sampled = set()

    def weights(self, step: int):
        """The scratch model holding the trained weights before step `step`'s update."""
        self.scratch.load_state_dict(self.weights_at[step])
        return self.scratch

    @staticmethod
    def grad_origins(loss, view, batch):
        """Origins of the tokens whose log-prob the term's loss actually depends on (autograd, not masks),
        and that gradient [B, T]."""
        import torch

        if not loss.requires_grad or not view.logprobs.requires_grad:
            return None, None
        (grad,) = torch.autograd.grad(loss, view.logprobs, retain_graph=True, allow_unused=True)
        if grad is None:
            return set(), torch.zeros_like(view.logprobs)
        return {ORIGINS[c] for c in batch.origin[grad.abs() > 0].unique().tolist()}, grad.detach().cpu()

    def check_behaviour(self, batch, engine, step, segment):
        """Behaviour log-probs = a fresh forward of the rollout weights at the spec's sampling temperature."""
        rollout = segment_spec(self.v, segment).rollout
        temp = float(rollout.temperature)
        fresh = fresh_logprobs(engine.model, batch.tokens, batch.attention_mask, temp)
        self.sampler_lp[id(batch.tokens)] = fresh
        self.keep.append(batch.tokens)
        known = batch.known_mask & batch.response_mask
        err = (fresh - batch.behavior_logprobs.cpu()).abs()[known.cpu()]
        # declared: vLLM serving bf16 weights computes with its own bf16 kernels, so agreement to bf16 noise only (the
        # hf engine rounds its weights and computes in float32: exact); the tolerance follows the spec, never the
        # engine's own report of its dtype (a sampler that silently ran another precision fails the sampler checks)
        if rollout.engine == "vllm" and rollout.precision == "bf16":
            self.bf16_errors.append((step, float(err.mean()) if err.numel() else 0.0,
                                     float(err.max()) if err.numel() else 0.0, int(err.numel())))
            if err.numel() and (float(err.mean()) > BF16_MEAN or float(err.max()) > BF16_MAX):
                self.logprob_errors.append((step, float(err.max()), int((err > BF16_MAX).sum()), int(err.numel())))
            return
        if err.numel() and float(err.max()) > TOL:
            self.logprob_errors.append((step, float(err.max()), int((err > TOL).sum()), int(err.numel())))


def run_recorded(path: Path, out_dir: Path, extra=(), as_declared: bool = False):
    """Run `path` short (or `as_declared`: with `extra` only), recorded; -> (validated, plan, recorder, metric rows)."""
    import csv

    import composer.runtime.rollout as rollout_mod
    from components.sources.outcome_reward import RewardScorer
    from composer.backends.lightning.run import train
    from composer.checks.validate import validate_file
    from composer.plan.compile import compile_plan
    from composer.protocol import POLICY

    overrides = list(extra) if as_declared else short(path, extra)
    v = validate_file(path, overrides)
    rec = Recorder(v)
    real_serve, real_verdicts = rollout_mod.serve, RewardScorer.verdicts

    def serve(ctx, key, requests, *scope):  # watch what the rollout weights sample (not how the run labels it)
        answers = real_serve(ctx, key, requests, *scope)
        if key[0] == "sample" and key[1] == POLICY and not key[2] and key[3] == "rollout":
            rec.on_sample(requests, answers)
        if key[0] == "sample" and key[3] == "teacher":  # a source writing sequences the policy did not write
            rec.on_write(key[1], requests, answers)
        return answers

    def verdicts(self, ctx, batch):  # the verifier's verdicts as it returned them
        out = real_verdicts(self, ctx, batch)
        rec.on_verdicts(self.cfg.verifier, ctx.step, ctx.segment, batch, out, self.cfg, ctx.task.verifier)
        return out

    from composer.backends.lightning.module import ComposerModule
    from composer.referee.optim import UpdateWatch

    real_configure = ComposerModule.configure_optimizers

    def configure_optimizers(self):  # every update of the run's optimiser, around its step (composer/referee/optim.py)
        out = real_configure(self)
        rec.updates = UpdateWatch(v, out["optimizer"], self.policy, rec.events)
        return out

    import components.guides.intervention as intervention

    real_successes = intervention.successes

    def successes(ctx, examples, texts):  # the verifier's verdicts on texts a guide judges (a model's traces)
        out = real_successes(ctx, examples, texts)
        rec.judged.update({(ex.problem, t): ok for ex, t, ok in zip(examples, texts, out)})
        return out

    intervention.successes = successes
    rollout_mod.serve, RewardScorer.verdicts = serve, verdicts
    ComposerModule.configure_optimizers = configure_optimizers
    try:
        train(v, Path(out_dir) / "run", progress=False, recorder=rec)
    finally:
        rollout_mod.serve, RewardScorer.verdicts = real_serve, real_verdicts
        intervention.successes = real_successes
        ComposerModule.configure_optimizers = real_configure
        if rec.updates is not None:
            rec.updates.active = False
    if rec.policy is not None:
        rec.final = {k: t.detach().clone() for k, t in rec.policy.state_dict().items()}
    rows = {}
    metrics = Path(out_dir) / "run" / "metrics.csv"
    if metrics.exists():
        with open(metrics, newline="") as f:
            rows = {int(r["step"]): r for r in csv.DictReader(f)}
    return v, compile_plan(v), rec, rows
