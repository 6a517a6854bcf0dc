"""Backend mappings are complete or absent (DESIGN.md section 11, "Backend mappings"; issue 52 item 4).

An objective may declare how its fields map onto OpenRLHF's own PolicyLoss (`openrlhf_native()`). Every field of
every registered objective that has such a mapping is enumerated here: a non-default value must change the launch
arguments (the mapping carries it), send the term through the composer's own loss in the plugin (the mapping does
not carry it), or be refused with a reason (at validate or compile), never dropped silently. The table of values
below must name every field, so that a new field fails this test until it is mapped or routed.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from composer.backends.openrlhf.flags import Inputs, Layout, Unsupported, build_runs, native_blockers
from composer.capabilities import departures
from composer.checks.validate import validate_file
from composer.errors import SpecError
from composer.registry import kinds, load_builtins

ROOT = Path(__file__).resolve().parent.parent
BASE = ROOT / "specs" / "grpo.yaml"  # a spec whose one term runs on OpenRLHF's own PolicyLoss

# one non-default value per field of each objective with a native mapping (kind and loss_tokens' choices aside)
NON_DEFAULT = {
    "grpo": {
        "loss_tokens": "[policy,prompt]",
        "estimator": "{kind: leave_one_out}",
        "ratio": "sequence",
        "bound": "mask",
        "valid_rows_scale": "true",
        "clip": "0.3",
        "clip_low": "0.1",
        "clip_high": "0.28",
        "dual_clip": "3.0",
        "sapo_tau_pos": "2.0",
        "sapo_tau_neg": "2.0",
        "std_norm": "false",
        "loss_agg": "seq-mean-token-mean",
        "norm_const": "100",
        "kl_coef": "0.01",
        "kl_estimator": "k2",
        "std_eps": "0.01",
        "token_selection": "{kind: kl_cov}",
        "off_policy_weight": "{kind: shaped}",
        "correction": "{kind: tis}",
    },
}


def _inputs() -> Inputs:
    return Inputs(policy_path="/models/policy", source_paths={}, train_file="data/train.jsonl",
                  train_rows={"main": 240}, eval_file=None, max_prompt_chars=64, max_solution_chars=128)


def _route(overrides: list[str]):
    """('refused', reason) | ('plugin', why) | ('native', argv) for specs/grpo.yaml with `overrides`."""
    try:
        v = validate_file(BASE, overrides)
    except SpecError as e:
        return "refused", str(e)
    try:
        run, = build_runs(v, Layout(), _inputs())
    except Unsupported as e:
        return "refused", str(e)
    if run.plugin["loss"]:
        return "plugin", "; ".join(native_blockers(v.segments[0].spec))
    return "native", run.argv


def _mapped_objectives() -> list[str]:
    """Registered objective kinds whose default configuration maps whole onto OpenRLHF's PolicyLoss."""
    load_builtins()
    out = []
    for kind, cls in kinds("objective").items():
        try:
            obj = cls()
        except Exception:  # noqa: BLE001 - a kind with required fields has no default configuration to map
            continue
        if not obj.openrlhf_native():
            out.append(kind)
    return out


def test_every_objective_with_a_native_mapping_is_enumerated():
    mapped = _mapped_objectives()
    assert mapped == ["grpo"], mapped  # the mappings this file enumerates; a new one must be added to NON_DEFAULT
    for kind in mapped:
        fields = set(kinds("objective")[kind].model_fields) - {"kind"}
        assert fields == set(NON_DEFAULT[kind]), f"{kind}: NON_DEFAULT must name exactly its fields"


def test_the_base_spec_runs_natively():
    route, argv = _route([])
    assert route == "native"
    assert "--algo.advantage.estimator group_norm" in " ".join(argv)


@pytest.mark.parametrize("field", sorted(NON_DEFAULT["grpo"]))
def test_a_non_default_field_changes_the_launch_or_takes_the_composers_loss(field):
    value = NON_DEFAULT["grpo"][field]
    _, base = _route([])
    route, what = _route([f"objective.{field}={value}"])
    if route == "native":
        assert what != base, f"objective.{field}={value}: the native launch arguments are those of the default"
    else:
        assert route in ("plugin", "refused") and what  # with its reason
        if route == "plugin":
            assert field in what or "estimator" in what, what


def test_valid_rows_scale_takes_the_composers_loss_and_says_why():
    """The issue's reproduction: `objective.valid_rows_scale=true` compiled to the same launch as without it."""
    route, why = _route(["objective.valid_rows_scale=true"])
    assert route == "plugin" and "valid_rows_scale" in why
    v = validate_file(BASE, ["objective.valid_rows_scale=true"])
    run, = build_runs(v, Layout(), _inputs())
    assert "--algo.advantage.estimator reinforce" in " ".join(run.argv)  # the composer's advantages, not group_norm
    assert any("valid_rows_scale: no OpenRLHF flag" in line for line in run.via_plugin)


def test_a_plugin_subclass_of_grpo_never_inherits_the_native_mapping():
    """A plugin that subclasses grpo may change its loss: the mapping is grpo's own, so it takes the composer's."""
    from components.objectives.grpo import Grpo

    class Shifted(Grpo):
        pass

    assert not Grpo().openrlhf_native() and Shifted().openrlhf_native()


def test_departures_lists_fields_away_from_their_defaults():
    from components.objectives.grpo import Grpo

    assert departures(Grpo()) == []
    assert departures(Grpo(clip=0.3, valid_rows_scale=True)) == ["valid_rows_scale", "clip"]
    assert departures(Grpo(token_selection={"kind": "kl_cov"})) == ["token_selection"]


# SFT on references runs through OpenRLHF's train_sft: one non-default value per field of its signal and objective
SFT = ROOT / "specs" / "sft.yaml"
SFT_NON_DEFAULT = {"signal.temperature": "0.5", "signal.filter_samples": "4", "signal.targets": "online",
                   "signal.problems": "16", "signal.leak_filter": "false", "signal.target": "guided",
                   "objective.aggregation": "seq-mean-token-mean", "objective.loss_tokens": "[demonstration,prompt]"}


def test_every_field_of_the_sft_route_is_enumerated():
    sig, obj = set(kinds("signal")["sft"].model_fields), set(kinds("objective")["cross_entropy"].model_fields)
    named = {k for k in SFT_NON_DEFAULT}
    assert named == {f"signal.{f}" for f in sig - {"kind"}} | {f"objective.{f}" for f in obj - {"kind"}}


@pytest.mark.parametrize("field", sorted(SFT_NON_DEFAULT))
def test_a_non_default_sft_field_changes_the_launch_or_is_refused(field):
    """signal.temperature=0.5 used to compile to the same train_sft launch as 1.0 (a silent drop)."""
    def route(overrides):
        try:
            v = validate_file(SFT, overrides)
            run, = build_runs(v, Layout(), _inputs())
        except (SpecError, Unsupported) as e:
            return "refused", str(e)
        return run.trainer, run.argv

    _, base = route([])
    kind, what = route([f"{field}={SFT_NON_DEFAULT[field]}"])
    assert kind == "refused" or what != base, f"{field}: the same train_sft launch as the default"
    if kind == "refused":
        assert what


def test_an_sft_temperature_is_refused_on_train_sft_with_the_field():
    v = validate_file(SFT, ["signal.temperature=0.5"])
    with pytest.raises(Unsupported) as e:
        build_runs(v, Layout(), _inputs())
    assert "signal.temperature" in str(e.value) and "train_sft has no flag" in str(e.value)


def test_no_backend_branches_on_a_component_kind():
    """A backend never names a kind (DESIGN.md section 10): the OpenRLHF route is chosen by the parts' own mappings
    (`openrlhf_native`, `openrlhf_trainer`, `openrlhf_sft`, `openrlhf_reward_part`, `openrlhf_flags`)."""
    import re

    pattern = re.compile(r"kind_name\(\)\s*[!=]=|\.kind\s*[!=]=\s*[\"']|kind_name\(\)\s+(not\s+)?in\s")
    found = [f"{p.relative_to(ROOT)}:{i}: {line.strip()}" for p in sorted((ROOT / "composer" / "backends").rglob("*.py"))
             for i, line in enumerate(p.read_text().splitlines(), 1) if pattern.search(line)]
    assert not found, "\n".join(found)


# PPO with a critic runs on OpenRLHF's own critic (flags.py _critic_objective / _critic_flags): one non-default value
# per field of ppo and of its critic; each changes the launch or is refused with the reason (VAPO's decoupled and
# length-adaptive lambdas are refused: OpenRLHF has one --algo.advantage.lambd for advantages and returns)
PPO = ROOT / "specs" / "methods" / "ppo.yaml"
PPO_NON_DEFAULT = {
    "objective.loss_tokens": "[policy,prompt]",
    "objective.gamma": "0.9",
    "objective.lambd": "adaptive",
    "objective.length_alpha": "0.1",
    "objective.critic_lambda": "1.0",
    "objective.whiten": "mean",
    "objective.kl_coef": "0.05",
    "objective.kl_estimator": "k3",
    "objective.clip": "0.3",
    "objective.clip_low": "0.1",
    "objective.clip_high": "0.28",
    "objective.loss_agg": "seq-mean-token-mean",
    "objective.critic.network": "shared",
    "objective.critic.model": "/models/critic",
    "objective.critic.lr": "1.0e-3",
    "objective.critic.value_clip": "0.5",
    "objective.critic.value_coef": "0.5",
    "objective.critic.trust_remote_code": "true",
}


def test_every_field_of_the_ppo_route_is_enumerated():
    from components.objectives.critic import Critic

    ppo = {f"objective.{f}" for f in set(kinds("objective")["ppo"].model_fields) - {"kind", "critic"}}
    critic = {f"objective.critic.{f}" for f in Critic.model_fields}
    assert set(PPO_NON_DEFAULT) == ppo | critic


def _ppo_route(overrides: list[str]):
    try:
        v = validate_file(PPO, ["policy.model=/models/policy", *overrides])
        run, = build_runs(v, Layout(nodes=1, gpus_per_node=2), _inputs())
    except SpecError as e:
        return "refused", str(e)
    except Unsupported as e:
        return "refused", f"{'.'.join(map(str, e.path))}: {e}"
    assert not run.plugin["loss"]  # a critic runs only on OpenRLHF's own PolicyLoss: never the composer's loss
    return "native", run.argv


def test_the_ppo_spec_runs_on_openrlhfs_critic():
    route, argv = _ppo_route([])
    assert route == "native" and "--critic.model_name_or_path" in argv


@pytest.mark.parametrize("field", sorted(PPO_NON_DEFAULT))
def test_a_non_default_ppo_field_changes_the_launch_or_is_refused(field):
    _, base = _ppo_route([])
    route, what = _ppo_route([f"{field}={PPO_NON_DEFAULT[field]}"])
    if route == "native":
        assert what != base, f"{field}: the same OpenRLHF launch as the default"
    else:
        assert what, field


@pytest.mark.parametrize("field,words", [("lambd", "no lambda per response length"),
                                         ("critic_lambda", "cannot take their own lambda")])
def test_vapos_lambdas_are_refused_with_the_reason(field, words):
    route, why = _ppo_route([f"objective.{field}={PPO_NON_DEFAULT['objective.' + field]}"])
    assert route == "refused" and f"objective.{field}" in why and words in why, why


def test_the_native_route_says_group_norms_epsilon():
    """OpenRLHF's group_norm divides by std + 1e-9, the composer's grpo by std + std_eps (1e-6): at the default the
    term stays native (the two differ by at most 1e-6 / std per advantage, below the parity test's 1e-4 for the toy's
    0/1 rewards) and the bundle's notes say it; any other std_eps takes the composer's loss (NON_DEFAULT above)."""
    v = validate_file(BASE)
    run, = build_runs(v, Layout(), _inputs())
    assert not run.plugin["loss"]
    assert any("std + 1e-9" in n and "std + 1e-06" in n for n in run.notes), run.notes
