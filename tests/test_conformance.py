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
And it recomputes the numbers (issue 26), with formulas written here and fresh forward passes of the
weights the plan declares, never with the run's own helpers:
  - each term's advantages from the batch's rewards, groups and control rows (ADVANTAGES: one entry per
    estimator), and the groups hold one prompt each;
  - every reference log-prob (batch.initial_logprobs) by a forward pass of the policy's weights at the
    stage's start (or the run's, train.reference: run_start);
  - the per-token gradient each term's loss puts on the policy's log-probs, from its formula (GRPO's clipped
    surrogate and KL to the stage-start weights; advantage regression's residual with every anchor as the
    spec declares it: the sampler's fresh log-prob for policy and Proxy tokens, kappa for Const tokens, the
    stage-start weights for A*PO);
  - teacher log-probs of self-teachers by a forward pass of the weights they declare (current, initial at
    the stage start, an EMA recomputed here from the policy's weights at every step);
  - every token labelled `policy` was sampled by the rollout weights, from exactly the text before it
    (never reference, prefix or judge text relabelled).
The runs are long and hot enough that weights move and groups are mixed, and the test asserts that they
did: a check that saw no update, no mixed group or no intervention fails rather than passes.
A divergence reintroduced anywhere (a zeroed log-prob, a dropped context, a missed sync, a stale phase,
batch-normalised advantages, a prefix trained as policy text, a substituted anchor, a stale reference, a
sampler one sync behind) fails here; each has a `catches` test below.
"""

from __future__ import annotations

import copy
import csv
import hashlib
import math
from pathlib import Path

import pytest
import torch
import yaml

from composer.origins import ORIGINS
from composer.plan.compile import compile_plan
from composer.checks.validate import validate_file

ROOT = Path(__file__).resolve().parent.parent
SPECS = sorted((ROOT / "specs").glob("**/*.yaml"))  # every folder under specs/, new ones included
# Hot enough to test the numbers: 4 prompts per step and 32 new tokens (the toy's 2- and 4-step chains fit, so
# groups mix and the weights move); the test fails if they did not.
FAST = ["train.prompts_per_step=4", "rollout.max_new_tokens=32", "train.eval_every=0", "train.eval_samples=2",
        "train.checkpoint_every=1000"]
# The toy student is bootstrapped on each machine (seeded, not bit-reproducible across machines) and solves
# the chains it was trained on (1-4 steps) nearly always: groups there may never mix. On 6-step chains it
# errs in most samples and gets some right, on any bootstrap, so every spec runs there (48 new tokens fit
# them) unless it names its own tiers below.
HARD = ["data.train_tiers=[6]", "rollout.max_new_tokens=48"]
# InT on its own tiers: its stages need targets the filter keeps and a GRPO stage that moves the weights,
# which 6-step chains alone do not give in three steps
HOT: dict[str, list[str]] = {"int": []}
GUIDE_ORIGINS = ("guide_prefix", "guide_intervention")
TOL = 2e-3  # float32 forward passes of different shapes (KV cache vs one pass)


def short(path: Path) -> list[str]:
    """Overrides that run every segment of the spec for 1-2 steps and sync within the run."""
    data = yaml.safe_load(path.read_text())
    v = validate_file(path)
    out = list(FAST)
    if data.get("stages"):
        out += [f"stages.{i}.train.steps=3" for i in range(len(data["stages"]))]
    elif data.get("phases"):
        out += [f"train.steps={2 * len(data['phases'])}"]
        out += [f"phases.{i}.until={2 * (i + 1)}" for i in range(len(data["phases"]))]
    else:
        out += ["train.steps=3"]
    out += HOT.get(path.stem, HARD)
    if any(s.spec.sync.every > 2 for s in v.segments) and not data.get("stages"):
        out += ["sync.every=2"]
    return out


def fingerprint(model) -> str:
    """A digest of every parameter's bytes (two models with equal weights give the same string)."""
    h = hashlib.sha1()
    for p in model.parameters():
        h.update(p.detach().float().cpu().numpy().tobytes())
    return h.hexdigest()


def fresh_logprobs(model, tokens, attention_mask, temperature: float):
    """[B, T] log p(tokens[b, t] | tokens[b, :t]) by one forward pass of `model` at `temperature` (0 at t = 0)."""
    dev = next(model.parameters()).device
    with torch.no_grad():
        logits = model(input_ids=tokens.to(dev), attention_mask=attention_mask.long().to(dev)).logits
    lp = torch.log_softmax(logits.float() / temperature, -1)
    out = torch.zeros(tokens.shape)
    out[:, 1:] = lp[:, :-1].gather(-1, tokens[:, 1:, None].to(dev)).squeeze(-1).cpu()
    return out


class Recorder:
    def __init__(self):
        self.events: list[tuple[str, dict]] = []
        self.logprob_errors: list[tuple] = []
        self.policy_at: dict[int, str] = {}  # step -> the trained weights before that step's update
        self.rollout_at: dict[int, str] = {}  # step -> the weights that sampled that step's rollouts
        self.weights_at: dict[int, dict] = {}  # step -> a copy of the trained weights before that step's update
        self.sampler_lp: dict[int, torch.Tensor] = {}  # id(rollout tokens) -> the sampler's fresh log-probs
        self.keep: list = []  # the rollout tensors whose ids key sampler_lp (kept alive)
        self.scratch = None  # a copy of the policy's architecture: fresh forwards of recorded weights
        self.sampled: set[tuple] = set()  # every prefix + sampled token the rollout weights produced this step
        self.not_sampled: list[tuple] = []  # (step, row, position) of `policy` tokens the policy never sampled
        self.policy_tokens_checked = 0
        self.tokenizer = None

    def __call__(self, kind, **data):
        if kind == "rollout":  # check now: the rollout weights are the ones that sampled this batch
            self.check_behaviour(data["batch"], data["engine"], data["step"])
            self.check_sampled(data["batch"], data["step"])
            self.policy_at.setdefault(data["step"], fingerprint(data["policy"]))
            self.rollout_at.setdefault(data["step"], fingerprint(data["engine"].model))
            if data["step"] not in self.weights_at:
                self.weights_at[data["step"]] = {k: t.detach().clone() for k, t in data["policy"].state_dict().items()}
            if self.scratch is None:
                self.scratch = copy.deepcopy(data["policy"]).eval().requires_grad_(False)
                self.tokenizer = data["engine"].tok
        if kind == "term_loss":  # now, before backward frees the graph
            data["grad_origins"], data["grad"] = self.grad_origins(data["loss"], data["view"], data["batch"])
        self.events.append((kind, data))

    def on_sample(self, requests, answers) -> None:
        """The rollout weights' sampled continuations (served by the run's driver): every prefix they extend."""
        for req, gens in zip(requests, answers):
            for g in gens:
                seq = tuple(req.tokens) + tuple(g.tokens)
                self.sampled.update(seq[: t + 1] for t in range(len(req.tokens), len(seq)))

    def check_sampled(self, batch, step):
        """Every token labelled `policy` was sampled by the rollout weights right after exactly the tokens
        before it in its row (so reference, prefix or judge text relabelled `policy` is caught)."""
        from composer.origins import CODE

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
        if not loss.requires_grad or not view.logprobs.requires_grad:
            return None, None
        (grad,) = torch.autograd.grad(loss, view.logprobs, retain_graph=True, allow_unused=True)
        if grad is None:
            return set(), torch.zeros_like(view.logprobs)
        return {ORIGINS[c] for c in batch.origin[grad.abs() > 0].unique().tolist()}, grad.detach().cpu()

    def check_behaviour(self, batch, engine, step):
        fresh = fresh_logprobs(engine.model, batch.tokens, batch.attention_mask, batch.info.get("temperature", 1.0))
        self.sampler_lp[id(batch.tokens)] = fresh
        self.keep.append(batch.tokens)
        known = batch.known_mask & batch.response_mask
        err = (fresh - batch.behavior_logprobs.cpu()).abs()[known.cpu()]
        if err.numel() and float(err.max()) > TOL:
            self.logprob_errors.append((step, float(err.max()), int((err > TOL).sum()), int(err.numel())))


def run_recorded(path: Path, tmp_path: Path, extra=()):
    import composer.runtime.rollout as rollout_mod
    from composer.backends.lightning.run import train
    from composer.protocol import POLICY

    v = validate_file(path, short(path) + list(extra))
    rec = Recorder()
    real = rollout_mod.serve

    def serve(ctx, key, requests, *scope):  # watch what the rollout weights sample (not how the run labels it)
        answers = real(ctx, key, requests, *scope)
        if key[0] == "sample" and key[1] == POLICY and not key[2] and key[3] == "rollout":
            rec.on_sample(requests, answers)
        return answers

    rollout_mod.serve = serve
    try:
        train(v, tmp_path / "run", progress=False, recorder=rec)
    finally:
        rollout_mod.serve = real
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


# ------------------------------------------------------------------------------------------------
# The numbers, recomputed (issue 26): formulas written here, weights from the recorder's own copies.
# ------------------------------------------------------------------------------------------------

ADVANTAGES: dict = {}  # objective kind -> f(objective, rewards, groups, control, policy tokens per row) -> advantages


def estimator(kind: str):
    def deco(fn):
        ADVANTAGES[kind] = fn
        return fn
    return deco


def _groups(group: list) -> dict:
    out: dict = {}
    for i, g in enumerate(group):
        out.setdefault(g, []).append(i)
    return out


def _std(xs: list) -> float:
    m = sum(xs) / len(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1)) if len(xs) > 1 else 0.0


@estimator("grpo")
def grpo_advantages(obj, r: list, group: list, control: list, n_policy: list) -> list:
    """The policy-gradient family's estimators (`objective.estimator`; omitted: group std, or none without
    std_norm). group_mean (GRPO, Shao et al. 2024): A_i = (r_i - mean_g r) / (sigma + eps), sigma the group's
    std (n - 1), the global batch's reward std, or 1 without eps (Dr. GRPO); an all-equal group gets exactly 0.
    leave_one_out (RLOO): r_i - mean of the group's other rows. reinforce_pp_baseline: r_i - mean_g r, then
    (x - mean_B x) / (std_B x + eps) over the batch's rows."""
    est = obj.estimator
    kind = "group_mean" if est is None else est.kind
    std = ("group" if obj.std_norm else "none") if est is None else getattr(est, "std", None)
    eps = obj.std_eps if est is None else getattr(est, "eps", None)
    out = [0.0] * len(r)
    for rows in _groups(group).values():
        rs = [r[i] for i in rows]
        mean = sum(rs) / len(rs)
        for i in rows:
            if kind == "reinforce_pp_baseline":
                out[i] = r[i] - mean
            elif max(rs) == min(rs):
                out[i] = 0.0
            elif kind == "leave_one_out":
                out[i] = r[i] - (sum(rs) - r[i]) / (len(rs) - 1)
            elif std == "group":
                out[i] = (r[i] - mean) / (_std(rs) + eps)
            elif std == "batch":
                out[i] = (r[i] - mean) / (_std(r) + eps)
            else:
                out[i] = r[i] - mean
    if kind == "reinforce_pp_baseline":
        m, sd = sum(out) / len(out), _std(out)
        out = [(x - m) / (sd + eps) for x in out]
    return out


@estimator("advantage_regression")
def regression_advantages(obj, r: list, group: list, control: list, n_policy: list) -> list:
    """A*PO / OAPL / MInTRL: A_i = r_i - V(x_i), V = beta1 ln((1/n) sum_j exp(r_j / beta1)) over the group's
    baseline rows (baseline control: its control rows; all its rows when it has none); beta1 = inf: their
    mean; beta1 = 0: their max."""
    out = [0.0] * len(r)
    for rows in _groups(group).values():
        base = [i for i in rows if control[i]] if obj.baseline == "control" else rows
        rs = [r[i] for i in (base or rows)]
        if math.isinf(obj.beta1):
            v = sum(rs) / len(rs)
        elif obj.beta1 == 0:
            v = max(rs)
        else:
            m = max(rs)
            v = m + obj.beta1 * math.log(sum(math.exp((x - m) / obj.beta1) for x in rs) / len(rs))
        for i in rows:
            out[i] = r[i] - v
    return out


@estimator("length_penalized_grpo")  # examples/custom_component: GRPO on r - penalty * max(0, n - free_tokens)
def length_penalized_advantages(obj, r: list, group: list, control: list, n_policy: list) -> list:
    shaped = [x - obj.penalty * max(0.0, n - obj.free_tokens) for x, n in zip(r, n_policy)]
    return grpo_advantages(obj, shaped, group, control, n_policy)


GRADIENTS: dict = {}  # objective kind -> f(objective, batch, cur, sampler, reference, advantages) -> (grad, unit)


def gradient(kind: str):
    def deco(fn):
        GRADIENTS[kind] = fn
        return fn
    return deco


def _token_weights(mask, agg: str):
    """[B, T] d(aggregate)/d(loss_t) of the aggregations; None for one this check does not cover."""
    m = mask.double()
    if agg == "token-mean":
        return m / m.sum().clamp(min=1)
    if agg == "seq-mean-token-mean":
        n = m.sum(-1, keepdim=True)
        rows = float((n > 0).sum())
        return torch.where(n > 0, m / n.clamp(min=1), torch.zeros_like(m)) / max(rows, 1.0)
    return None


def grpo_formula_covers(obj) -> bool:
    """The settings grpo_gradient's formula is written for: token ratio, PPO clip without dual clip, token-mean or
    seq-mean-token-mean. The others (GSPO's sequence ratio, CISPO, masking, dual clip, token sums) are
    recomputed by hand in tests/test_methods_runs.py and against TRL in tests/test_trl_parity.py."""
    return (getattr(obj, "ratio", "token") == "token" and getattr(obj, "bound", "clip") == "clip"
            and getattr(obj, "dual_clip", None) is None and obj.loss_agg in ("token-mean", "seq-mean-token-mean"))


def covered(obj) -> bool:
    """Whether GRADIENTS has a formula for this objective's settings."""
    return obj.kind_name() in GRADIENTS and (obj.kind_name() != "grpo" or grpo_formula_covers(obj))


@gradient("grpo")
def grpo_gradient(obj, b, cur, sampler, ref, adv):
    """d loss / d log pi(y_t) of GRPO on its loss tokens, with rho_t = exp(lp_t - lp_sampler_t):
    w_t * (-A_i rho_t [where the clip does not bind] + kl_coef * d k(lp_t - lp_ref_t)), k3' = 1 - exp(ref - lp).
    Unit: 1 / w_t (a coefficient of order A)."""
    if not grpo_formula_covers(obj):
        return None, None
    mask = b.mask(obj.loss_tokens) & b.attention_mask
    if b.row_mask is not None:  # a term gate: rows outside it get no loss
        mask = mask & b.row_mask.cpu()[:, None]
    w = _token_weights(mask, obj.loss_agg)
    lo = obj.clip if obj.clip_low is None else obj.clip_low
    hi = obj.clip if obj.clip_high is None else obj.clip_high
    A = torch.tensor(adv, dtype=torch.float64)[:, None]  # [B, 1]
    rho = torch.exp(cur.double() - sampler.double())  # [B, T]
    inside = (rho >= 1 - lo) & (rho <= 1 + hi)
    unclipped_min = rho * A <= rho.clamp(1 - lo, 1 + hi) * A
    pg = torch.where(inside | unclipped_min, -A * rho, torch.zeros_like(rho))
    kl = torch.zeros_like(rho)
    if obj.kl_coef > 0:
        d = cur.double() - ref.double()
        dk = {"k1": torch.ones_like(d), "k2": d, "k3": 1 - torch.exp(-d)}[obj.kl_estimator]
        kl = obj.kl_coef * dk
    unit = 1.0 / float(w[mask].max()) if mask.any() else 1.0
    return w * (pg + kl) * mask, unit


GRADIENTS["length_penalized_grpo"] = grpo_gradient  # the plugin keeps GRPO's loss


@gradient("advantage_regression")
def regression_gradient(obj, b, cur, sampler, ref, adv):
    """L = sum_i w_i (beta2 [sum_t m_t (lp_t - anchor_t)] - A_i)^2 / sum_i w_i, so on a loss token of row i
    d L / d lp_t = 2 beta2 w_i (beta2 lr_i - A_i) / sum_i w_i. The anchor as the spec declares it: policy
    tokens the sampler's log-prob (reference initial, A*PO: the stage-start weights'); another origin a
    constant kappa where the spec gives a number (Const), else the sampler's log-prob (Proxy).
    Unit: 1 / (2 beta2 w_i / W), i.e. the comparison is on each row's residual."""
    from composer.origins import CODE

    mask = b.mask(obj.loss_tokens) & b.attention_mask
    anchor = sampler.double().clone()
    if obj.reference == "initial":
        anchor = torch.where(b.origin == CODE["policy"], ref.double(), anchor)
    for origin, a in obj.anchor.items():
        if not isinstance(a, str):
            anchor = torch.where(b.origin == CODE[origin], torch.full_like(anchor, float(a)), anchor)
    lr = torch.where(mask, cur.double() - anchor, torch.zeros_like(anchor)).sum(-1)  # [B]
    w = (b.seq_weight if b.seq_weight is not None else torch.ones(b.size)).double()
    coef = 2 * obj.beta2 * w * (obj.beta2 * lr - torch.tensor(adv, dtype=torch.float64)) / w.sum()
    unit = float(w.sum()) / (2 * obj.beta2 * float(w.max()))
    return coef[:, None] * mask, unit


def stage_start(plan: dict, spec, step: int) -> int:
    """The step whose starting weights are the reference of `step`: its stage's first step (the run's
    start without stages or with train.reference: run_start)."""
    seg = segment_of(plan, step)
    if seg.get("stage") is None or spec.train.reference == "run_start":
        return 0
    return min(s["start"] for s in plan["segments"] if s.get("stage") == seg["stage"])


def ema_weights(rec: Recorder, start: int, step: int, rate: float) -> dict:
    """theta_T at `step`: the weights at `start`, then theta_T <- (1 - rate) theta_T + rate theta after every
    optimiser step (SDPO), from the recorder's copies of the policy at every step."""
    ema = {k: t.clone().double() for k, t in rec.weights_at[start].items()}
    for s in range(start + 1, step + 1):
        for k, t in rec.weights_at[s].items():
            ema[k] = (1 - rate) * ema[k] + rate * t.double()
    return {k: t.to(rec.weights_at[start][k].dtype) for k, t in ema.items()}


def teacher_model(rec: Recorder, spec, plan: dict, name: str, step: int, cache: dict):
    """The weights teacher `name` declares, at `step`: its own checkpoint, or for `self` the policy's
    current weights, those at the stage start (initial) or their EMA."""
    from composer.runtime.models import load_model, resolve

    src = spec.sources[name]
    if not src.is_self:
        if name not in cache:
            cache[name] = load_model(resolve(src.model), spec.policy.dtype).eval()
        return cache[name]
    if src.weights == "current":
        return rec.weights(step)
    start = stage_start(plan, spec, step)
    if src.weights == "initial":
        return rec.weights(start)
    rec.scratch.load_state_dict(ema_weights(rec, start, step, src.ema_rate))
    return rec.scratch


def teacher_logprobs(model, b, prompt_ids: list, temperature: float):
    """Each row's response tokens scored by `model` after its own prompt ids (None: the row's prompt), as
    one sequence per row: [B, T] aligned with b.tokens, 0 off the response."""
    from composer.origins import CODE

    out = torch.zeros(b.tokens.shape)
    n_tok = b.attention_mask.sum(1).tolist()
    for i in range(b.size):
        P = int((b.origin[i] == CODE["prompt"]).sum())
        prompt = b.tokens[i, :P].tolist() if prompt_ids[i] is None else prompt_ids[i]
        seq = torch.tensor([prompt + b.tokens[i, P: n_tok[i]].tolist()])
        lp = fresh_logprobs(model, seq, torch.ones_like(seq), temperature)[0]
        out[i, P: n_tok[i]] = lp[len(prompt):]
    return out


def check_numbers(v, plan: dict, rec: Recorder, tokenizer_of) -> dict:
    """Every recomputation over the recorded term losses; returns what was seen (counts)."""
    from composer.origins import CODE
    from composer.checks.terms import terms

    seen = {"advantages": 0, "mixed_groups": 0, "reference": 0, "gradient": 0, "teacher": 0, "interventions": 0}
    models: dict = {}
    for kind, e in rec.events:
        if kind != "term_loss":
            continue
        b, obj, step = e["batch"], e["objective"], e["step"]
        seg = segment_of(plan, step)
        spec = next(s.spec for s in v.segments if s.name == seg["name"])
        sig = next(s for n, s, _o, _w in terms(spec) if n == e["term"])
        temp = b.info.get("temperature", 1.0)
        resp = b.response_mask
        seen["interventions"] += int((b.origin == CODE["guide_intervention"]).sum())

        adv = None
        if b.advantages is not None:
            assert obj.kind_name() in ADVANTAGES, \
                f"{obj.kind_name()} has advantages but no independent formula: add one to ADVANTAGES"
            r, g, c = b.rewards.double().tolist(), b.group.tolist(), b.control.tolist()
            adv = ADVANTAGES[obj.kind_name()](obj, r, g, c, b.mask(("policy",)).sum(-1).tolist())
            got = b.advantages.double().tolist()
            bad = [(i, got[i], adv[i]) for i in range(len(adv)) if abs(got[i] - adv[i]) > 1e-4 * (1 + abs(adv[i]))]
            assert not bad, f"step {step} {e['term']}: advantages (row, run, formula) differ: {bad[:4]}"
            for rows in _groups(g).values():
                assert len({b.examples[i].prompt for i in rows}) == 1, f"step {step}: a group mixes prompts"
                seen["mixed_groups"] += len({r[i] for i in rows}) > 1
            seen["advantages"] += 1

        ref = None
        start = stage_start(plan, spec, step)
        if b.initial_logprobs is not None:
            assert start in rec.weights_at, f"step {step}: no record of the weights at step {start} (the reference)"
            ref = fresh_logprobs(rec.weights(start), b.tokens, b.attention_mask, temp)
            err = float((ref - b.initial_logprobs.cpu()).abs()[resp].max()) if resp.any() else 0.0
            assert err <= TOL, (f"step {step} {e['term']}: reference log-probs are not those of the weights at the "
                                f"stage's start (step {start}): off by {err:.3g}")
            seen["reference"] += 1

        if b.teacher_logprobs is not None and sig.kind_name() == "distillation":
            src = spec.sources[sig.teacher]
            if not src.is_self or step in rec.weights_at:
                if src.context:  # the teacher prompts the run recorded, in row order, for rows with a text
                    texts = [p["text"] for k, p in rec.events if k == "prompt" and p["step"] == step
                             and p["source"] == sig.teacher and p["usage"] == "teacher"]
                    rows = [i for i in range(b.size) if float(b.weights()[i]) > 0]
                    assert len(texts) == len(rows), f"step {step}: {len(texts)} teacher prompts for {len(rows)} rows"
                    ids = [None] * b.size
                    for i, text in zip(rows, texts):
                        ids[i] = tokenizer_of(src).encode(text, add_special_tokens=False)
                else:
                    rows, ids = list(range(b.size)), [None] * b.size
                model = teacher_model(rec, spec, plan, sig.teacher, step, models)
                want = teacher_logprobs(model, b, ids, src.temperature)
                m = resp.clone()
                m[[i for i in range(b.size) if i not in rows]] = False
                err = float((want - b.teacher_logprobs.cpu()).abs()[m].max()) if m.any() else 0.0
                assert err <= TOL, (f"step {step}: teacher '{sig.teacher}' log-probs are not those of the weights "
                                    f"it declares ({src.weights if src.is_self else src.model}): off by {err:.3g}")
                seen["teacher"] += bool(m.any())

        # the sampler's fresh log-probs of the rollout; a batch a rollout filter assembled from several rollouts
        # carries their behaviour log-probs, each checked against a fresh forward when it was sampled
        sampler = rec.sampler_lp.get(id(b.tokens))
        if sampler is None and b.behavior_logprobs is not None and step in rec.rollout_at:
            sampler = b.behavior_logprobs.detach().cpu()
        if e["grad"] is not None and obj.kind_name() in GRADIENTS and sampler is not None:
            if ref is None and start in rec.weights_at:
                ref = fresh_logprobs(rec.weights(start), b.tokens, b.attention_mask, temp)
            cur = e["view"].logprobs.detach().cpu()
            want, unit = GRADIENTS[obj.kind_name()](obj, b, cur, sampler, ref, adv)
            if want is not None:
                err = float((want - e["grad"].double()).abs().max()) * unit
                assert err <= 5e-3, (f"step {step} {e['term']}: the loss's gradient differs from "
                                     f"{obj.kind_name()}'s formula with the declared advantages and anchors "
                                     f"(by {err:.3g} per unit)")
                seen["gradient"] += 1
    return seen


@pytest.mark.parametrize("path", SPECS, ids=lambda p: str(p.relative_to(ROOT)))
def test_spec_runs_as_declared(path, tmp_path):
    check_run(path, tmp_path)


def check_run(path: Path, tmp_path: Path, extra=()):
    """Run `path` (short, recorded) and check everything above; `extra` overrides come last."""
    from composer.checks.terms import scored_origins, terms

    v, plan, rec, rows = run_recorded(path, tmp_path, extra)
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

    # 7. every `policy` token was sampled by the rollout weights from the tokens before it
    assert not rec.not_sampled, ("tokens labelled policy that the rollout weights never sampled after the text "
                                 f"before them (step, row, position): {rec.not_sampled[:5]}")
    rolls = bool(rec.rollout_at)
    assert not rolls or rec.policy_tokens_checked, "rollouts without a single policy token checked"

    # 8. the numbers, recomputed: advantages, references, teachers, each loss's gradient
    def tokenizer_of(src):
        from composer.runtime.models import load_tokenizer, resolve

        return rec.tokenizer if src.is_self or src.shares_tokenizer else load_tokenizer(resolve(src.model))

    seen = check_numbers(v, plan, rec, tokenizer_of)
    objectives = [(seg, obj) for seg in v.segments for _n, _s, obj, _w in terms(seg.spec) if obj is not None]
    if any(type(obj).uses_group_baseline for _seg, obj in objectives) and rolls:
        assert seen["advantages"] and seen["mixed_groups"], f"no mixed group seen: nothing tested the advantages {seen}"
    if any(obj.wants_initial for _seg, obj in objectives) and rolls:
        assert seen["reference"], f"no reference log-prob checked {seen}"
    if any(covered(obj) for _seg, obj in objectives) and rolls:
        assert seen["gradient"], f"no gradient checked against its formula {seen}"
    if any(sig is not None and sig.kind_name() == "distillation" for seg in v.segments
           for _n, sig, _o, _w in terms(seg.spec)):
        assert seen["teacher"], f"no teacher log-prob checked {seen}"
    if any("guide_intervention" in obj.loss_tokens and covered(obj) for _seg, obj in objectives):
        assert seen["interventions"], f"no intervention token trained: the anchors of interventions went untested {seen}"

    # 9. the weights moved, and the sampler check compared weights that differ from the sync before
    if len(rec.rollout_at) >= 2:
        assert len(set(rec.policy_at.values())) >= 2, "the policy's weights never moved: the sync checks saw nothing"
        effective = 0
        for s in rec.rollout_at:
            syncs = [0] + [d for d in declared if d <= s]
            last, prev = syncs[-1], syncs[-2] if len(syncs) > 1 else None
            if prev is not None and last in rec.policy_at and prev in rec.policy_at:
                effective += rec.policy_at[last] != rec.policy_at[prev]
        if len([d for d in declared if d <= max(rec.rollout_at)]) >= 1 and any(
                d in rec.policy_at for d in declared):
            assert effective, "no step's sampler could be told from the sampler of the sync before it"

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
    import composer.prompts as prompts

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


# ------------------------------------------------------------------------------------------------
# Each divergence of issue 26, introduced on purpose, fails the check (and names what it saw).
# ------------------------------------------------------------------------------------------------

# InT with the toy's step oracle as proposer: every failed attempt gets an intervention, so the SFT stage moves
# the weights whatever the proposer model would write
ORACLE_INT = ["sources.oracle.kind=oracle", "rollout.guide.judge=oracle", "stages.0.signal.filter_samples=0"]


def test_conformance_catches_batch_normalised_advantages(tmp_path, monkeypatch):
    """GRPO's advantages normalised over the whole batch instead of each prompt's group fail the
    recomputation of the advantages."""
    from components.objectives.estimators import GroupMean

    real = GroupMean.estimate
    monkeypatch.setattr(GroupMean, "estimate", lambda self, r, g, c=None: real(self, r, torch.zeros_like(g), c))
    with pytest.raises(AssertionError, match="advantages"):
        test_spec_runs_as_declared(ROOT / "specs" / "grpo.yaml", tmp_path)


def test_conformance_catches_a_prefix_trained_as_policy_text(tmp_path, monkeypatch):
    """POPE's reference prefix written into the response as `policy` tokens, with exact log-probs of the
    rollout weights (so the behaviour check passes and the prefix gets loss), fails the sampled-by-policy
    check."""
    from components.guides.prefix import PrefixGuide
    from composer.protocol import POLICY, Sample, Score, Trace

    def row(self, ctx, example, index, n):
        chosen = self.chosen(ctx, example)
        k = self.steps_for(ctx, example) if chosen else 0
        sep = ctx.task.step_split
        prompt = ctx.prompt_ids(example)
        prefix = ctx.encode(sep.join(self.ref_steps(ctx, example)[:k]) + sep) if k else []
        trace = Trace(prompt, control=k == 0, guided=k > 0, tag="guided" if k else "")
        if prefix:
            lps = yield Score(prompt + prefix, len(prompt), POLICY)
            trace.add(prefix, "policy", lps)
        trace.notes.update(prefix_steps=k, chosen=chosen, ref_steps=len(self.ref_steps(ctx, example)))
        [gen] = yield Sample(trace.tokens, ctx.max_new_tokens - len(prefix))
        trace.add(gen.tokens, "policy", gen.logprobs)
        return trace

    monkeypatch.setattr(PrefixGuide, "row", row)
    with pytest.raises(AssertionError, match="never sampled"):
        test_spec_runs_as_declared(ROOT / "specs" / "pope.yaml", tmp_path)


def test_conformance_catches_a_substituted_anchor(tmp_path, monkeypatch):
    """The Proxy anchor (the spec's `guide_intervention: policy`) silently replaced by a Const anchor fails
    the recomputation of the loss's gradient from the declared anchors."""
    from components.objectives.advantage_regression import AdvantageRegression
    from composer.origins import CODE

    real = AdvantageRegression.anchor_logprobs

    def const(self, batch):
        a = real(self, batch)
        return torch.where(batch.origin == CODE["guide_intervention"], torch.full_like(a, -0.2), a)

    monkeypatch.setattr(AdvantageRegression, "anchor_logprobs", const)
    with pytest.raises(AssertionError, match="gradient differs"):  # MInTRL-Proxy (the oracle judge intervenes)
        check_run(ROOT / "specs" / "mintrl.yaml", tmp_path, ["objective.anchor.guide_intervention=policy"])


def test_conformance_catches_a_stale_stage_reference(tmp_path, monkeypatch):
    """A later stage whose KL reference is not refreshed to the weights at its start fails the fresh forward
    of the stage-start weights."""
    from composer.runtime.context import ModelServer

    monkeypatch.setattr(ModelServer, "refresh_initial", lambda self: None)
    with pytest.raises(AssertionError, match="reference log-probs"):  # InT's RL stage after its SFT stage
        check_run(ROOT / "specs" / "int.yaml", tmp_path, ORACLE_INT)


def test_conformance_catches_a_sampler_one_sync_behind(tmp_path, monkeypatch):
    """A rollout engine that loads, at each sync, the weights of the sync before (one sync behind) fails on
    the first spec: the runs move the weights, and the test asserts that they did."""
    from composer.runtime.engine import HFEngine

    def sync(self, policy, step):
        if getattr(self, "_previous", None) is not None:
            self.model.load_state_dict(self._previous)
        self._previous = {k: t.detach().clone() for k, t in policy.state_dict().items()}
        self.last_sync = step

    monkeypatch.setattr(HFEngine, "sync", sync)
    with pytest.raises(AssertionError, match="rollouts sampled by weights other than"):
        test_spec_runs_as_declared(ROOT / "specs" / "grpo.yaml", tmp_path)
