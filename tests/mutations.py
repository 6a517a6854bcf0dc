"""Mutation proof of the referee (issue 40, DESIGN.md section 10): plausible one-line bugs injected into the CODE of
the components, one at a time, each run on a shipped spec as declared (shortened by the referee like every check);
the table says which the referee caught.

    PYTHONPATH=. .venv/bin/python tests/mutations.py                     # every mutation, the referee
    PYTHONPATH=. .venv/bin/python tests/mutations.py --before OLD.py     # also the conformance test OLD.py's check_run
    PYTHONPATH=. .venv/bin/python tests/mutations.py k3_k1 dapo_filter   # some of them

Each mutation is a source patch of one line (the function recompiled from its patched source in its own module)
or a one-line replacement of a function; `confirm` says how the bug shows in what ran (so a mutation that
changes nothing is not counted as caught or missed: see the `changed` column).
"""

from __future__ import annotations

import contextlib
import importlib.util
import inspect
import sys
import tempfile
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def patch_source(undo: list, owner, name: str, old: str, new: str) -> None:
    """Recompile `owner.name` from its source with `old` replaced by `new` (one occurrence, which must exist)."""
    fn = getattr(owner, name)
    src = textwrap.dedent(inspect.getsource(fn))
    if src.count(old) != 1:
        raise RuntimeError(f"{owner.__name__}.{name}: the line to mutate is not there once: {old!r}")
    ns: dict = {}
    exec(compile(src.replace(old, new), inspect.getsourcefile(fn), "exec"), fn.__globals__, ns)
    undo.append((owner, name, fn))
    setattr(owner, name, ns[name])


def replace(undo: list, owner, name: str, value) -> None:
    undo.append((owner, name, getattr(owner, name)))
    setattr(owner, name, value)


def m_k3_k1(undo):
    import components.objectives.grpo as grpo

    real = grpo.kl_estimate
    replace(undo, grpo, "kl_estimate", lambda delta, est: real(delta, {"k1": "k3", "k3": "k1"}.get(est, est)))


def m_ema_frozen(undo):
    from components.sources.policy_model import ModelSource

    patch_source(undo, ModelSource, "after_optimizer_step", "rate = self.cfg.ema_rate", "rate = 0.0")


def m_control_guided(undo):
    from components.guides.intervention import InterventionGuide

    patch_source(undo, InterventionGuide, "row", "reviewable = not s.trace.control and",
                 "reviewable = (not s.trace.control or index == 0) and")


def m_gate_inverted(undo):
    import composer.gates as gates

    patch_source(undo, gates, "gate_rows", 'keep &= success if gate.outcome == "success" else ~success',
                 'keep &= ~success if gate.outcome == "success" else success')


def m_dapo_filter(undo):
    import composer.filters as filters

    patch_source(undo, filters, "equal_prompts", "out[p] = bool((r == r[0]).all())", "out[p] = False")


def m_loss_t1(undo):
    import composer.runtime.models as models

    patch_source(undo, models, "policy_view", 'batch.info.get("temperature", 1.0)', "1.0")


def m_stale_reference(undo):
    from composer.runtime.context import ModelServer

    replace(undo, ModelServer, "refresh_initial", lambda self: None)


# A second set, not issue 40's: bugs in what the first referee took on trust (the optimiser's side of the step,
# the reward's parts, a term's weight) and in the parts added since (stage optimizer state, periodic resets).

def m_opt_kept_at_stage(undo):
    from composer.backends.lightning.module import ComposerModule

    patch_source(undo, ComposerModule, "_enter", "if at.optimizer_reset:", "if False:")


def m_lr_not_stepped(undo):
    from composer.backends.lightning.module import ComposerModule

    patch_source(undo, ComposerModule, "_updates", "self.lr_schedulers().step()", "None")


def m_weight_dropped(undo):
    import composer.step as step

    patch_source(undo, step, "loss", "total = total + term.weight * (shares or {}).get(term.index, 1.0) * value",
                 "total = total + (shares or {}).get(term.index, 1.0) * value")


def m_clip_skipped(undo):
    from composer.backends.lightning.module import ComposerModule

    patch_source(undo, ComposerModule, "configure_gradient_clipping", "if clip:", "if False:")


def m_entropy_sign(undo):
    import composer.step as step

    patch_source(undo, step, "loss", "total = total - entropy_bonus(", "total = total + entropy_bonus(")


def m_weight_decay_ignored(undo):
    from composer.backends.lightning.module import ComposerModule

    patch_source(undo, ComposerModule, "_enter", "weight_decay=t.weight_decay)", "weight_decay=0.0)")


def m_overlong_sign(undo):
    from components.signals.reward import RewardSignal

    patch_source(undo, RewardSignal, "apply", "r = r + w * part", "r = r - w * part")


def m_ema_rate(undo):
    from components.sources.policy_model import ModelSource

    patch_source(undo, ModelSource, "after_optimizer_step", "rate = self.cfg.ema_rate",
                 "rate = 1 - 2 * (1 - self.cfg.ema_rate)")


def m_prefix_too_long(undo):
    from components.guides.prefix import PrefixGuide

    patch_source(undo, PrefixGuide, "max_steps", "math.floor(self.max_fraction * n_steps)",
                 "math.floor(2 * self.max_fraction * n_steps)")


def m_ppo_lambda(undo):
    import components.objectives.ppo as ppo

    patch_source(undo, ppo, "gae", "running = delta + decay * running", "running = delta + gamma * running")


def m_vapo_critic_lambda(undo):
    from components.objectives.ppo import Ppo

    patch_source(undo, Ppo, "advantages", "if self.decoupled:", "if False:")


def m_vapo_unclamped(undo):
    import components.objectives.ppo as ppo

    patch_source(undo, ppo, "adaptive_lambda", ".clamp(0.0, 1.0)", ".clamp(max=1.0)")


def m_frozen_policy_trains(undo):
    from composer.backends.lightning.module import ComposerModule

    patch_source(undo, ComposerModule, "step_loss", "if at.policy_frozen:", "if False:")


def m_ppo_value_clip(undo):
    import components.objectives.ppo as ppo

    patch_source(undo, ppo, "value_loss_tokens", "if clip is None:", "if True:")


def m_critic_frozen(undo):
    from components.objectives.critic import ValueModel

    patch_source(undo, ValueModel, "step", "self.opt.step()", "pass")


def m_rm_position(undo):
    from components.sources.reward_model import RewardModelScorer

    patch_source(undo, RewardModelScorer, "raw_scores", "last = mask.long().sum(1) - 1", "last = mask.long().sum(1) - 2")


def m_schedule_off_by_one(undo):
    from composer.lang.curves import Schedule

    patch_source(undo, Schedule, "at", "frac = min(max(step - self.begin, 0), self.steps) / self.steps",
                 "frac = min(max(step - self.begin + 1, 0), self.steps) / self.steps")


def m_old_from_sampler(undo):
    from composer.backends.lightning.module import ComposerModule

    patch_source(undo, ComposerModule, "_updates",
                 "run_step.old_logprobs(batches, lambda b, want, read: models.policy_view(model, b, want, read))",
                 "[setattr(b, 'old_logprobs', b.behavior_logprobs.detach().clone()) for b in batches]")


def m_sft_scaled(undo):
    import components.objectives.cross_entropy as ce

    patch_source(undo, ce, "cross_entropy_loss", "return aggregate(-logp, mask, mode)",
                 "return 1.5 * aggregate(-logp, mask, mode)")


def m_pg_scaled(undo):
    from components.objectives.grpo import Grpo

    patch_source(undo, Grpo, "loss", "pg_loss = aggregate(loss_tok, mask, self.loss_agg, self.norm_const)",
                 "pg_loss = 1.5 * aggregate(loss_tok, mask, self.loss_agg, self.norm_const)")


def m_opd_doubled(undo):
    import components.objectives.divergence as div

    patch_source(undo, div, "sampled_distill_loss", "adv = (-kl_coef * (behavior_logp - teacher_logp)).detach()",
                 "adv = (-2 * kl_coef * (behavior_logp - teacher_logp)).detach()")


def m_divergence_scaled(undo):
    from components.objectives.divergence import Divergence

    patch_source(undo, Divergence, "loss", "loss = aggregate(loss_tok, mask, self.aggregation, seq_weight=s)",
                 "loss = 1.5 * aggregate(loss_tok, mask, self.aggregation, seq_weight=s)")


def m_loo_off_by_one(undo):
    from components.objectives.estimators import LeaveOneOut

    patch_source(undo, LeaveOneOut, "estimate", "adv = (rewards.detach() - mean) * n / (n - 1).clamp(min=1)",
                 "adv = (rewards.detach() - mean) * (n + 1) / n.clamp(min=1)")


def m_verdict_shifted(undo):
    from components.sources.outcome_reward import RewardScorer

    patch_source(undo, RewardScorer, "verdicts", "zip(texts, batch.examples)",
                 "zip(texts, batch.examples[1:] + batch.examples[:1])")


def m_dpo_no_reference(undo):
    import components.objectives.dpo_pair as dpo

    patch_source(undo, dpo, "sequence_log_ratio",
                 "return (torch.where(mask, logp, zero) - torch.where(mask, ref.detach().to(logp.dtype), zero)).sum(-1)",
                 "return torch.where(mask, logp, zero).sum(-1)")


def m_dpo_pairs_swapped(undo):
    from components.objectives.dpo_pair import DpoPair

    patch_source(undo, DpoPair, "loss", "per_pair = dpo_pair_loss(s, win, lose, self.beta)",
                 "per_pair = dpo_pair_loss(s, lose, win, self.beta)")


def m_pairs_split(undo):
    import composer.step as step

    patch_source(undo, step, "mini_batches",
                 "rows = [torch.nonzero(torch.isin(b.group, part)).flatten() for part in torch.tensor_split(ids, n)]",
                 "rows = [torch.arange(k, b.size, n) for k in range(n)]")


# name -> (description, mutation, spec, extra overrides)
MUTATIONS = {
    "k3_k1": ("KL estimator k3 <-> k1 (kl_coef 0.001)", m_k3_k1, "specs/grpo.yaml", []),
    "ema_frozen": ("SRPO's EMA teacher frozen", m_ema_frozen, "specs/methods/srpo.yaml", []),
    "control_guided": ("a MInTRL control row guided", m_control_guided, "specs/mintrl.yaml", []),
    "gate_srpo": ("gate inverted (SRPO)", m_gate_inverted, "specs/methods/srpo.yaml", []),
    "gate_kdrl": ("gate inverted (KDRL-mask)", m_gate_inverted, "specs/methods/kdrl-mask.yaml", []),
    "dapo_filter": ("DAPO's filter keeps all-equal groups", m_dapo_filter, "specs/methods/dapo.yaml", []),
    "t1_opsd": ("loss log-probs at T=1, sampler 1.1 (OPSD)", m_loss_t1, "specs/opsd.yaml", []),
    "t1_gkd": ("loss log-probs at T=1, sampler 0.9 (GKD)", m_loss_t1, "specs/methods/gkd.yaml", []),
    "t1_grpo": ("loss log-probs at T=1, sampler 0.7 (GRPO, rollout.temperature=0.7)", m_loss_t1, "specs/grpo.yaml",
                ["rollout.temperature=0.7"]),
    "stale_ref_int": ("a later stage keeps stage 1's reference (InT)", m_stale_reference, "specs/int.yaml", []),
    "stale_ref_curriculum": ("a later stage keeps stage 1's reference (sft-opd-grpo)", m_stale_reference,
                             "specs/hybrids/sft-opd-grpo.yaml", []),
    # the second set
    "opt_kept_stage": ("AdamW moments kept at a stage's start (optimizer_at_stage: reset)", m_opt_kept_at_stage,
                       "specs/hybrids/sft-opd-grpo.yaml", []),
    "periodic_ref": ("ProRL's periodic reference reset skipped", m_stale_reference, "specs/methods/prorl.yaml", []),
    "lr_not_stepped": ("LR schedule frozen with several updates a step (DAPO, train.warmup_steps=3)",
                       m_lr_not_stepped, "specs/methods/dapo.yaml", ["train.warmup_steps=3"]),
    "weight_dropped": ("a term's weight dropped (KDRL's scheduled KL weight)", m_weight_dropped,
                       "specs/methods/kdrl.yaml", []),
    "clip_skipped": ("the gradient clip skipped (SFT)", m_clip_skipped, "specs/sft.yaml", []),
    "entropy_sign": ("entropy bonus with the wrong sign (GRPO, train.entropy_coef=0.01)", m_entropy_sign,
                     "specs/grpo.yaml", ["train.entropy_coef=0.01"]),
    "weight_decay": ("AdamW weight decay ignored (GRPO, train.weight_decay=0.1)", m_weight_decay_ignored,
                     "specs/grpo.yaml", ["train.weight_decay=0.1"]),
    "overlong_sign": ("DAPO's overlong penalty added with the wrong sign", m_overlong_sign,
                      "specs/methods/dapo.yaml", []),
    "ema_rate": ("SRPO's EMA teacher updated twice as fast", m_ema_rate, "specs/methods/srpo.yaml", []),
    "prefix_long": ("POPE's prefixes up to twice max_fraction", m_prefix_too_long, "specs/pope.yaml", []),
    # PPO's critic (issue 46, part 5)
    "ppo_lambda": ("PPO's GAE ignores lambda (lambda 1)", m_ppo_lambda, "specs/methods/ppo.yaml", []),
    "ppo_value_clip": ("PPO's value clip dropped", m_ppo_value_clip, "specs/methods/ppo.yaml", []),
    "critic_frozen": ("the critic's optimizer never steps", m_critic_frozen, "specs/methods/ppo.yaml", []),
    # VAPO's parts (issue 54, item 5)
    "vapo_critic_lambda": ("VAPO's critic targets at the policy's lambda (decoupled GAE dropped)", m_vapo_critic_lambda,
                           "specs/methods/vapo.yaml", []),
    "vapo_unclamped": ("VAPO's length-adaptive lambda not clamped at 0 (negative below 1/alpha tokens)",
                       m_vapo_unclamped, "specs/methods/vapo.yaml", []),
    "frozen_policy_trains": ("train.freeze_policy ignored: the policy trains in VAPO's value pre-training",
                             m_frozen_policy_trains, "specs/methods/vapo.yaml", []),
    "rm_position": ("the reward model read one token before the last", m_rm_position, "specs/methods/ppo-rm.yaml", []),
    # the referee evaluates schedules itself (issue 52): an off-by-one in the Plan's Schedule.at
    "old_from_sampler": ("the ratio's old log-probs taken from the lagged sampler, not the step's start (GRPO, 2 epochs, "
                         "sync every 2)", m_old_from_sampler, "specs/grpo.yaml",
                         ["train.epochs=2", "sync.every=2", "sync.off_policy_ok=true", "train.lr=0.003"]),
    "sft_scaled": ("SFT's loss scaled by 1.5 (issue 52)", m_sft_scaled, "specs/sft.yaml", []),
    "gspo_scaled": ("GSPO's policy loss scaled by 1.5 (issue 52)", m_pg_scaled, "specs/methods/gspo.yaml", []),
    "opd_doubled": ("OPD's sampled estimator's coefficient doubled", m_opd_doubled, "specs/opd.yaml", []),
    "opd_scaled": ("OPD's loss scaled by 1.5 inside its objective (issue 52)", m_divergence_scaled, "specs/opd.yaml",
                   []),
    "schedule_step": ("a schedule one step ahead (KDRL's KD weight, a 4-step ramp)", m_schedule_off_by_one,
                      "specs/methods/kdrl.yaml", ["terms.1.weight.steps=4", "terms.1.weight.end=0.5"]),
    "loo_off_by_one": ("RLOO's leave-one-out baseline off by one (n+1 / n for n / (n-1))", m_loo_off_by_one,
                       "specs/methods/rloo.yaml", []),
    "verdict_shifted": ("each response scored against the next row's example (the verifier's inputs off by one row)",
                        m_verdict_shifted, "specs/grpo.yaml", []),
    "dpo_no_reference": ("the DPO pair term's sequence log-ratio without the reference (log pi(y) alone)",
                         m_dpo_no_reference, "specs/methods/grpo-dpo.yaml", []),
    "dpo_pairs_swapped": ("the DPO pair term's chosen and rejected rows swapped", m_dpo_pairs_swapped,
                          "specs/methods/grpo-dpo.yaml", []),
    "pairs_split": ("mini-batches of interleaved rows, not whole groups (GRPO + DPO pairs, 2 mini-batches)",
                    m_pairs_split, "specs/methods/grpo-dpo.yaml", ["train.mini_batches=2"]),
}
SECOND = ["opt_kept_stage", "periodic_ref", "lr_not_stepped", "weight_dropped", "clip_skipped", "entropy_sign",
          "weight_decay", "overlong_sign", "ema_rate", "prefix_long"]
FAST = ["k3_k1", "dapo_filter", "opt_kept_stage", "overlong_sign", "ppo_lambda", "sft_scaled", "old_from_sampler",
        "gspo_scaled"]  # the default suite's subset
# (tests/test_conformance.py)


@contextlib.contextmanager
def mutated(name: str):
    undo: list = []
    try:
        MUTATIONS[name][1](undo)
        yield
    finally:
        for owner, attr, value in reversed(undo):
            setattr(owner, attr, value)


def referee_verdict(name: str, tmp: Path) -> tuple[bool, str]:
    """(caught, its failures, one per line, the first first) of the referee on the mutated code."""
    from composer.referee import referee

    _d, _m, spec, extra = MUTATIONS[name]
    with mutated(name):
        try:
            rep = referee(ROOT / spec, tmp, extra)
        except Exception as e:  # the run itself broke: the bug is seen, not by a check
            return True, f"the run failed: {type(e).__name__}: {str(e)[:120]}"
    fails = rep.failures()
    return bool(fails), "\n".join(fails)


def before_verdict(module, name: str, tmp: Path) -> tuple[bool, str]:
    """(caught, message) of an older conformance test's check_run(path, tmp_path, extra)."""
    _d, _m, spec, extra = MUTATIONS[name]
    with mutated(name):
        try:
            module.check_run(ROOT / spec, tmp, extra)
        except AssertionError as e:
            return True, str(e).splitlines()[0][:160]
        except Exception as e:
            return True, f"the run failed: {type(e).__name__}: {str(e)[:120]}"
    return False, ""


def main(argv: list[str]) -> int:
    before = None
    if "--before" in argv:
        i = argv.index("--before")
        spec = importlib.util.spec_from_file_location("conformance_before", argv[i + 1])
        before = importlib.util.module_from_spec(spec)
        sys.path.insert(0, str(ROOT / "tests"))
        spec.loader.exec_module(before)
        argv = argv[:i] + argv[i + 2:]
    names = argv or list(MUTATIONS)
    rows = []
    for name in names:
        t0 = time.time()
        with tempfile.TemporaryDirectory() as tmp:
            b = before_verdict(before, name, Path(tmp) / "before") if before else None
            a = referee_verdict(name, Path(tmp) / "after")
        rows.append((name, b, a, time.time() - t0))
        print(f"{name}: before {'-' if b is None else ('caught' if b[0] else 'MISSED')}, "
              f"referee {'caught' if a[0] else 'MISSED'} ({time.time() - t0:.0f}s) {a[1].partition(chr(10))[0][:200]}", flush=True)
    print("\n| mutation | spec | before (test_conformance) | after (referee) | first failure |")
    print("|---|---|---|---|---|")
    for name, b, a, _t in rows:
        desc, _m, spec, extra = MUTATIONS[name]
        bt = "-" if b is None else ("caught" if b[0] else "missed")
        print(f"| {desc} | {spec}{' ' + ' '.join(extra) if extra else ''} | {bt} | {'caught' if a[0] else 'MISSED'} "
              f"| {a[1].partition(chr(10))[0][:140].replace('|', '/')} |")
    return 0 if all(a[0] for _n, _b, a, _t in rows) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
