"""specs/methods/ of issue 24: each validates, `explain` states its defining mechanism in text, and (slow) each
runs 3 steps on the toy testbed with a non-zero loss."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from composer.checks.validate import validate_file

ROOT = Path(__file__).resolve().parent.parent
MECHANISM = {  # spec -> text explain must show
    "tool-grpo.yaml": "the policy may call calculator (Hermes <tool_call> JSON; a turn stops at </tool_call>) and reads "
                      "the answer as environment tokens",
    "srpo.yaml": "gate: distill trains only on rows where the rollout failed and another rollout of its group",
    "hpt.yaml": "gate: sft trains only on rows where no rollout of its group succeeded",
    "kdrl-mask.yaml": "gate: kd trains only on rows where the rollout failed",
    "dapo.yaml": "filter: drop prompts whose rewards are all equal and sample more until the step is full",
    "gkd.yaml": "reference solutions from 'reference' instead of the rollouts for a fraction 0.5 of prompts (GKD lambda 0.5)",
    "prefixrl.yaml": "a prefix whose length is drawn per problem uniformly from 0 to 0.75 of the tokens of",
    "prorl.yaml": "reference reset (initial weights <- the policy) before step(s) 20, 40",
    "topr.yaml": "ratio: per trajectory: pi(tau)/mu(tau) = exp(sum_t log rho_t); bound: TOPR: A log pi for A >= 0, sg(clip(rho, 0, 1)) A log pi for A < 0",
    "gmpo.yaml": "bound: GMPO: each token's log-ratio clipped to [-0.4, 0.4] (by the sign of A) inside the geometric mean",
    "gpg.yaml": "x alpha = B / B_valid (rows over rows with a non-zero advantage, GPG)",
    "kl-cov.yaml": "KL-Cov: the top max(1, floor(0.01 N)) of the step's N loss tokens by Cov_t",
    "clip-cov.yaml": "Clip-Cov: max(1, floor(0.01 N)) of the step's N loss tokens with 0.02 < Cov_t < 5",
    "entropy-8020.yaml": "80/20 high-entropy update: only the top max(1, ceil(0.2 N)) of the step's N loss tokens by "
                         "the old policy's entropy H_t",
    "archer.yaml": "Archer dual-token constraints: tokens whose old-policy entropy H_t is above the 0.8-quantile of its "
                   "response's entropies are high-entropy: clip [1-0.5, 1+0.5] and KL coefficient 0; the others keep "
                   "the term's clip and kl_coef",
    "ppo.yaml": "advantage: GAE gamma 1, lambda 0.95 over the critic's old values; r_t = -0.01 x k1(log pi_old - "
                "log pi_ref) + R at the last token",
    "ppo-rm.yaml": "score with 'rm' (reward model toy:reward on the rollout's token ids, score at the last token)",
    "luffy.yaml": "1 of each prompt's 8 rows are traces the policy did not write (the reference text of 'reference' + "
                  "EOS",
    "sapo.yaml": "bound: SAPO soft gate -(4/tau) sigmoid(tau (rho - 1)) A, tau 1 for A > 0 and 1.05 otherwise",
    "nsr.yaml": "advantage: sign-weighted, no baseline (NSR): A = 0 for a success (reward >= 0.5), -1 for a failure",
    "psr.yaml": "advantage: sign-weighted, no baseline (PSR): A = +1 for a success (reward >= 0.5), 0 for a failure",
    "w-reinforce.yaml": "advantage: sign-weighted, no baseline (W-REINFORCE, lambda 0.1): A = +0.1 for a success "
                        "(reward >= 0.5), -1 for a failure",
    "grpo-dpo.yaml": "online DPO pairs: the highest- and the lowest-reward rollout of each group (rewards distinct); "
                     "loss -log sigmoid(0.1 ((log pi(y_w) - log pi_ref(y_w)) - (log pi(y_l) - log pi_ref(y_l))))",
    "vapo.yaml": "advantage: GAE gamma 1, lambda_policy = 1 - 1/(0.05 l) per response (length-adaptive, VAPO; l its "
                 "action tokens; clamped to [0, 1]) over the critic's old values",
}
MECHANISM_MORE = {  # further lines explain must show
    "vapo.yaml": ["critic targets: G = A^c + V_old, A^c GAE at its own lambda 1 (decoupled GAE",
                  "bound: PPO clip [1-0.2, 1+0.28]; aggregation: token-mean",
                  "nll: sft -> cross_entropy (weight 0.1)", "SFT on the policy's own rollouts of the step",
                  "gate: only rows where the rollout succeeded",
                  "policy: frozen (train.freeze_policy): no policy loss and no policy update; the critic alone learns",
                  "critic: ppo: carried on from the previous phase (weights, AdamW state, update count)"],
    "luffy.yaml": ["all in one advantage group, the traces scored by the same reward",
                   "tokens the policy did not write (demonstration): loss -A w(pi), w = pi / (pi + 0.1) (LUFFY's policy "
                   "shaping), no ratio, no clip", "aggregation: token-mean; no KL loss"],
}


# the policy-gradient specs train on tiers where the toy student's groups are mixed (their shipped tiers are the
# default's, where the first steps' groups are often all-equal), so the loss is that of a learning signal
HOT = {n: ["data.train_tiers=[6]", "rollout.max_new_tokens=48"] for n in ("cispo.yaml", "dr-grpo.yaml", "gspo.yaml", "rloo.yaml",
                                              "reinforce-pp-baseline.yaml", "kdrl.yaml", "srpo.yaml", "kdrl-mask.yaml",
                                              "prorl.yaml", "topr.yaml", "gmpo.yaml", "gpg.yaml",
                                              "kl-cov.yaml", "clip-cov.yaml", "luffy.yaml", "ppo.yaml", "ppo-rm.yaml",
                                              "sapo.yaml", "nsr.yaml", "psr.yaml", "w-reinforce.yaml", "grpo-dpo.yaml")}

HOT["vapo.yaml"] = ["data.train_tiers=[4,6]", "rollout.max_new_tokens=48"]  # successes for its NLL term
HOT["tool-grpo.yaml"] = ["data.train_tiers=[6]", "rollout.max_new_tokens=128"]  # 6-step chains: mixed groups; room for a call
HOT["archer.yaml"] = HOT["kl-cov.yaml"]  # Archer's classes act only where the groups are mixed (A != 0)


@pytest.mark.parametrize("name", sorted(MECHANISM))
def test_explain_shows_the_defining_mechanism(name):
    from composer.plan.explain import text
    from composer.plan.compile import compile_plan

    out = text(compile_plan(validate_file(ROOT / "specs" / "methods" / name)))
    for line in [MECHANISM[name], *MECHANISM_MORE.get(name, [])]:
        assert line in out, out


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(p.name for p in (ROOT / "specs" / "methods").glob("*.yaml")))
def test_runs_three_steps_on_the_toy_with_a_nonzero_loss(name, tmp_path):
    from composer.backends.lightning.run import train

    v = validate_file(ROOT / "specs" / "methods" / name,
                      HOT.get(name, []) + ["train.steps=3", "train.prompts_per_step=4", "train.eval_every=0", "train.eval_samples=2",
                       "train.checkpoint_every=1000", "train.samples_every=0"])
    train(v, tmp_path, progress=False)
    rows = [r for r in csv.DictReader(open(tmp_path / "metrics.csv")) if r.get("loss")]
    assert len(rows) == 3
    assert any(abs(float(r["loss"])) > 0 for r in rows), [r["loss"] for r in rows]
