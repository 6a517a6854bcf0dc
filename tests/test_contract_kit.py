"""The contract test kit (composer/testing.py) over every built-in component, and proof that it can fail."""

from __future__ import annotations

from typing import Literal

import pytest
from pydantic import Field

from composer import registry
from composer.testing import check_component, check_objective, synthetic_batch

registry.load_all()

# every built-in objective, and each setting that changes its aggregation or estimator
OBJECTIVES = [("grpo", {"loss_agg": a}) for a in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum",
                                                   "seq-mean-token-sum-norm", "token-sum")]
OBJECTIVES += [("grpo", {"loss_agg": "seq-mean-token-sum-norm", "norm_const": 7.0}), ("grpo", {"kl_coef": 0.0})]
OBJECTIVES += [("cross_entropy", {"aggregation": a}) for a in ("token-mean", "seq-mean-token-mean", "token-sum")]
OBJECTIVES += [("divergence", {"estimator": e, "k": 4}) for e in ("sampled", "full", "top_k")]
OBJECTIVES += [("divergence", {"estimator": "full", "measure": m, "aggregation": "seq-mean-token-mean"})
               for m in ("forward_kl", "jsd")]
OBJECTIVES += [("advantage_regression", {}), ("advantage_regression", {"baseline": "control"})]
OBJECTIVES += [("grpo", {"token_selection": {"kind": "kl_cov", "k": 0.1}}),  # step-wide selection (issue 46)
               ("grpo", {"token_selection": {"kind": "clip_cov", "r": 0.1, "omega_low": 0.01}})]
# tokens the policy did not write in the loss, with a weight form (LUFFY's shaping; every form), and a KL term
OBJECTIVES += [("grpo", {"loss_tokens": ["policy", "guide_prefix", "guide_intervention", "demonstration"],
                         "off_policy_weight": w, "kl_coef": 0.01}) for w in
               ({"kind": "shaped", "gamma": 0.1}, {"kind": "prob"}, {"kind": "pow", "alpha": 0.5}, {"kind": "log"})]
OBJECTIVES += [("grpo", {"loss_tokens": ["policy", "demonstration"], "off_policy_weight": {"kind": "shaped"},
                         "ratio": "sequence", "loss_agg": "seq-mean-token-mean"})]
OBJECTIVES += [("ppo", {}), ("ppo", {"loss_agg": "seq-mean-token-mean", "whiten": "mean"})]  # a critic's GAE (issue 46)
# a term over pairs of rows (issue 54): the kit splits it by whole groups
OBJECTIVES += [("dpo_pair", {}), ("dpo_pair", {"pairs": "all_distinct", "beta": 0.5})]


def test_the_list_covers_every_registered_objective():
    builtin = {k for k, cls in registry.kinds("objective").items() if not cls.plugin}  # a test may have loaded a plugin
    assert {k for k, _ in OBJECTIVES} == builtin


@pytest.mark.parametrize("kind,cfg", OBJECTIVES, ids=[f"{k}-{'-'.join(map(str, c.values())) or 'default'}"
                                                       for k, c in OBJECTIVES])
def test_every_builtin_objective_passes_the_kit(kind, cfg):
    obj = registry.lookup("objective", kind)(**cfg)
    check_component(obj)
    out = check_objective(obj)
    assert out["loss"] != 0.0  # the synthetic batch gives each objective something to train on


@pytest.mark.parametrize("section", ["sources", "guide", "signal"])
def test_every_builtin_component_declares_its_parts(section):
    for cls in registry.kinds(section).values():
        fields = {n: f for n, f in cls.model_fields.items() if f.is_required()}
        if fields:  # required fields (a reference, a judge): the kit needs an instance; fill them with names
            obj = cls.model_construct(**{n: "x" for n in fields})
        else:
            obj = cls()
        check_component(obj)


# ---- the kit can fail ----

def _token_mean_with_row_normaliser():
    from components.objectives.base import Objective, aggregate

    class RowNormalised(Objective):
        """token-mean loss with a mean-over-sequences normaliser: the issue's silently wrong plugin."""

        kind: Literal["row_normalised"] = Field("row_normalised", description="kind")

        def loss(self, batch, view, adv):
            mask = self.loss_mask(batch)
            return aggregate(-view.logprobs, mask, "token-mean"), {}

        def normalizer(self, batch):
            return self.loss_mask(batch).any(-1).sum().float()

    return RowNormalised()


def test_the_kit_catches_a_normaliser_that_does_not_match_the_aggregation():
    with pytest.raises(AssertionError, match="do not add up"):
        check_objective(_token_mean_with_row_normaliser())


def test_an_objective_without_reduction_or_normalizer_is_refused_when_defined():
    from components.objectives.base import Objective

    with pytest.raises(TypeError, match="reduction"):
        class Bare(Objective):
            kind: Literal["bare"] = Field("bare", description="kind")

            def loss(self, batch, view, adv):
                return view.logprobs.sum(), {}


def test_a_declared_reduction_gives_the_normaliser():
    from components.objectives.base import Objective, Reduction, aggregate

    class Declared(Objective):
        kind: Literal["declared"] = Field("declared", description="kind")

        def reduction(self):
            return Reduction("seq-mean-token-mean")

        def loss(self, batch, view, adv):
            return aggregate(-view.logprobs, self.loss_mask(batch), "seq-mean-token-mean"), {}

    obj = Declared()
    batch, _ = synthetic_batch()
    rows = int((obj.loss_mask(batch).sum(-1) > 0).sum())  # seq-mean: rows with a loss token
    assert float(obj.normalizer(batch)) == rows
    check_objective(obj)


def test_the_kit_catches_a_loss_that_reads_outside_its_read_mask():
    """The policy forward promises log-probs only at `read_mask` (0 elsewhere): a loss whose metric reads every
    response token while it trains on policy tokens must declare it, and the kit says so when it does not."""
    from components.objectives.base import Objective, Reduction, aggregate

    class Peeks(Objective):
        kind: Literal["peeks"] = Field("peeks", description="kind")

        def reduction(self):
            return Reduction("token-mean")

        def loss(self, batch, view, adv):
            seen = batch.response_mask
            return aggregate(-view.logprobs, self.loss_mask(batch), "token-mean"), \
                {"response_nll": float(-(view.logprobs.detach() * seen).sum() / seen.sum())}

    with pytest.raises(AssertionError, match="outside read_mask"):
        check_objective(Peeks(loss_tokens=["policy"]))

    class Declares(Peeks):
        def read_mask(self, batch):
            return self.loss_mask(batch) | batch.response_mask

    check_objective(Declares(loss_tokens=["policy"]))
