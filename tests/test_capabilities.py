"""Capabilities (composer/capabilities.py): one record per component and spec section, with safe defaults, from
which the OpenRLHF bundle's refusals are derived (composer/backends/openrlhf/flags.py `LACKS`).

A plugin is written into tmp_path and run in a fresh process (as tests/test_plugins.py does), so its kind never
joins this process's registry."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from composer.capabilities import FEATURES, Capabilities, Need, needs
from composer.checks.validate import validate_file

ROOT = Path(__file__).resolve().parent.parent

PLUGIN = '''
from typing import ClassVar, Literal
from pydantic import Field
from components.objectives.base import Objective, Reduction, aggregate, group_advantages
from composer.capabilities import Capabilities, Need
from composer.registry import register


@register("objective")
class Silent(Objective):
    """REINFORCE with a group baseline; says nothing about its capabilities."""
    kind: Literal["silent_pg"] = Field("silent_pg", description="Component kind.")
    needs: ClassVar = ("reward",)

    def advantages(self, batch):
        return group_advantages(batch.rewards, batch.group)

    def loss(self, batch, view, adv):
        return aggregate(-(adv[:, None] * view.logprobs), self.loss_mask(batch), "token-mean"), {}

    def reduction(self):
        return Reduction("token-mean")


@register("objective")
class Lagged(Silent):
    """The same loss, declared sound off-policy."""
    kind: Literal["lagged_pg"] = Field("lagged_pg", description="Component kind.")

    def capabilities(self):
        return Capabilities(on_policy_only=False)


@register("objective")
class Masked(Silent):
    """The same loss, declaring that it needs a step-wide per-token mask."""
    kind: Literal["masked_pg"] = Field("masked_pg", description="Component kind.")

    def capabilities(self):
        return Capabilities(needs=(Need("step_token_mask"),))
'''

PROBE = r'''
import json, sys
from composer.backends.openrlhf.flags import Unsupported, check_capabilities
from composer.checks.validate import validate_file
from composer.errors import SpecError
out = {}
for kind in ("silent_pg", "lagged_pg", "masked_pg"):
    for every in (1, 4):
        key = f"{kind}/{every}"
        try:
            v = validate_file(sys.argv[1], [f"objective.kind={kind}", f"sync.every={every}"])
        except SpecError as e:
            out[key] = {"invalid": [d.rule for d in e.diagnostics]}
            continue
        try:
            check_capabilities(v.spec, ())
            out[key] = {"openrlhf": "runs"}
        except Unsupported as e:
            out[key] = {"openrlhf": list(e.path), "reason": e.reason}
print(json.dumps(out))
'''


@pytest.fixture(scope="module")
def probed(tmp_path_factory):
    d = tmp_path_factory.mktemp("caps")
    (d / "caps_plugin.py").write_text(PLUGIN)
    (d / "spec.yaml").write_text("name: caps\nplugins: [caps_plugin]\nsources:\n  verifier: {kind: outcome_reward}\n"
                                 "signal: {kind: reward, source: verifier}\nobjective: {kind: silent_pg}\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(d), str(ROOT)]), "COMPOSER_ALLOW_PLUGINS": "1"}
    r = subprocess.run([sys.executable, "-c", PROBE, str(d / "spec.yaml")], capture_output=True, text=True, env=env,
                       cwd=ROOT, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_a_plugin_that_says_nothing_is_on_policy_only(probed):
    """The safe default: a lagged sampler is refused for an objective that declares nothing (it used to validate)."""
    assert probed["silent_pg/1"] == {"openrlhf": "runs"}
    assert probed["silent_pg/4"] == {"invalid": ["lag_needs_correction"]}
    assert probed["lagged_pg/4"] == {"openrlhf": "runs"}  # declared sound off-policy: the lag is allowed


def test_a_declared_need_is_refused_by_a_backend_that_lacks_it(probed):
    """The refusal comes from the component's record and the backend's LACKS, not from a list of kinds."""
    got = probed["masked_pg/1"]
    assert got["openrlhf"] == ["objective"] and "per-token mask has no carrier there" in got["reason"]


def test_defaults_and_declared_features():
    assert Capabilities() == Capabilities(on_policy_only=True, exact_origins=frozenset(), needs=())
    with pytest.raises(ValueError, match="unknown backend feature"):
        Need("telepathy")


@pytest.mark.parametrize("spec,path,feature", [
    ("specs/methods/kl-cov.yaml", ("objective", "token_selection"), "step_token_mask"),
    ("specs/methods/prorl.yaml", ("train", "reset_every"), "periodic_reset"),
    ("specs/methods/gkd.yaml", ("signal", "off_policy"), "sequences_not_sampled"),
    ("specs/methods/dapo.yaml", ("rollout", "filter", "max_rounds"), "capped_refill"),
    ("specs/methods/grpo-dpo.yaml", ("terms", 1, "objective"), "coupled_rows"),
])
def test_shipped_specs_declare_what_they_need(spec, path, feature):
    got = needs(validate_file(ROOT / spec).spec)
    assert (path, feature) in [(p, n.feature) for p, n in got]


def test_grpo_needs_nothing_and_every_lack_is_a_feature():
    from composer.backends.openrlhf.flags import LACKS

    assert needs(validate_file(ROOT / "specs" / "grpo.yaml").spec) == []
    assert set(LACKS) <= set(FEATURES)
