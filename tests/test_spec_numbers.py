"""Numbers in a spec are finite: infinity and nan are refused in every float field (issue 57 item 6).

`.inf` was accepted in a dozen fields where it means nothing (grpo's norm_const, a teacher's temperature, lora's
alpha ...) and the string "nan" passed where `.nan` was refused. The refusal lives in one place, the
registry.NumbersNotBooleans mixin every spec model and component is built on; a field where infinity is a
documented value opts in (INFINITY_ALLOWED below), and its bounds still refuse nan and -inf.
"""

from __future__ import annotations

import re
import types
import typing
from pathlib import Path

import pytest
from _helpers import HEAD, cli
from pydantic import BaseModel, ValidationError

from composer import registry
from composer.checks.validate import validate_file
from composer.lang.spec import spec_model

REPO = Path(__file__).resolve().parent.parent

# (model class name, field): fields whose documented values include .inf (the plain mean of a soft-max baseline)
INFINITY_ALLOWED = {("AdvantageRegression", "beta1"), ("SoftValue", "beta1")}
NON_FINITE = [float("inf"), float("-inf"), float("nan"), "inf", "-inf", "nan", "Infinity", "NaN"]


def _models(annotation, found: dict) -> None:
    """Every pydantic model reachable from `annotation` (through unions, lists, dicts and fields)."""
    if typing.get_origin(annotation) is not None:
        for arg in typing.get_args(annotation):
            _models(arg, found)
    elif isinstance(annotation, type) and issubclass(annotation, BaseModel) and annotation not in found.values():
        found[f"{annotation.__module__}.{annotation.__qualname__}.{id(annotation)}"] = annotation
        for f in annotation.model_fields.values():
            _models(f.annotation, found)


def _scalars(annotation) -> set:
    """The non-model scalar types an annotation takes (through Annotated, unions, lists and dicts)."""
    origin = typing.get_origin(annotation)
    if origin is typing.Literal:
        return {type(a) for a in typing.get_args(annotation)}
    if origin is not None:
        return set().union(*(_scalars(a) for a in typing.get_args(annotation)))
    return {annotation} if annotation in (int, float, bool, str) else set()


def _shaped(annotation, value):
    """`value` where the annotation puts its number: an item of a list, a value of a dict, else itself."""
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        return _shaped(typing.get_args(annotation)[0], value)
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in typing.get_args(annotation) if a is not type(None)]
        return _shaped(inner[0], value) if len(inner) == 1 else value
    if origin is list:
        return [value, value]
    if origin is dict:
        return {"x": value}
    return value


def float_fields():
    """(model, field name) of every float field of the spec's models and of every registered component."""
    registry.load_all()
    found: dict = {}
    _models(spec_model(), found)
    for section in registry.SECTIONS:
        for cls in registry.kinds(section).values():
            _models(cls, found)
    return sorted({(m, n) for m in found.values() for n, f in m.model_fields.items() if float in _scalars(f.annotation)},
                  key=lambda mf: (mf[0].__name__, mf[1]))


FIELDS = float_fields()


def _errors_at(model, name: str, value) -> list[dict]:
    field = model.model_fields[name]
    try:
        model.model_validate({field.alias or name: _shaped(field.annotation, value)})
    except ValidationError as e:
        return [x for x in e.errors() if x["loc"][:1] == (field.alias or name,)]
    return []


def test_the_enumeration_finds_the_reported_fields():
    names = {(m.__name__, n) for m, n in FIELDS}
    for reported in [("Grpo", "norm_const"), ("Grpo", "std_eps"), ("GroupMean", "eps"), ("AdvantageRegression", "beta2"),
                     ("Divergence", "kl_coef"), ("PolicyModel", "temperature"), ("OverlongPenalty", "factor"),
                     ("Lora", "alpha"), ("ClipCov", "omega_high"), ("KlCov", "beta"), ("Shaped", "gamma"),
                     ("Ppo", "clip"), ("OutcomeReward", "success_threshold"), ("Train", "betas")]:
        assert reported in names
    assert INFINITY_ALLOWED <= names  # the allow-list names fields that exist
    assert len(FIELDS) > 50


@pytest.mark.parametrize("model,name", FIELDS, ids=[f"{m.__name__}.{n}" for m, n in FIELDS])
def test_every_float_field_refuses_infinity_and_nan(model, name):
    takes_text = str in _scalars(model.model_fields[name].annotation)  # chat_template_kwargs: "nan" is text there
    for value in NON_FINITE:
        if isinstance(value, str) and takes_text:
            continue
        allowed = (model.__name__, name) in INFINITY_ALLOWED and value in (float("inf"), "inf", "Infinity")
        errors = _errors_at(model, name, value)
        if allowed:
            assert not errors, (value, errors)
        else:
            assert errors, f"{model.__name__}.{name} accepted {value!r}"


def _validate(cli, tmp_path, spec: str, *overrides):
    return cli("validate", REPO / spec, *overrides)


@pytest.mark.parametrize("spec,override", [
    ("specs/grpo.yaml", "objective.norm_const=.inf"),
    ("specs/grpo.yaml", "objective.std_eps=.inf"),
    ("specs/grpo.yaml", "objective.estimator={kind: group_mean, eps: .inf}"),
    ("specs/oapl.yaml", "objective.beta2=.inf"),
    ("specs/methods/exopd.yaml", "terms.0.objective.kl_coef=.inf"),
    ("specs/methods/gkd.yaml", "sources.teacher.temperature=.inf"),
    ("specs/methods/dapo.yaml", "sources.overlong.factor=.inf"),
    ("specs/grpo.yaml", "policy.lora={alpha: .inf}"),
    ("specs/methods/clip-cov.yaml", "objective.token_selection.omega_high=.inf"),
    ("specs/methods/kl-cov.yaml", "objective.token_selection.beta=.inf"),
    ("specs/methods/luffy.yaml", "objective.off_policy_weight.gamma=.inf"),
    ("specs/methods/ppo.yaml", "objective.clip=.inf"),
    ("specs/grpo.yaml", "sources.verifier.success_threshold=.inf"),
    ("specs/grpo.yaml", "objective.clip=nan"),  # the string "nan": was accepted where .nan was refused
    ("specs/grpo.yaml", "objective.clip=-inf"),
    ("specs/methods/dapo.yaml", "signal.plus.overlong=inf"),
])
def test_a_reported_infinity_is_refused_at_validate(cli, tmp_path, spec, override):
    r = _validate(cli, tmp_path, spec, override)
    assert r.exit_code == 2, r.stderr
    path = override.split("=", 1)[0].replace(".0.", "[0].")
    assert re.search(rf"<override '{re.escape(override)}'>:1:1: error: {re.escape(path)}[.a-z_]*: "
                     r".* is not a finite number", r.stderr), r.stderr
    assert "hint: " in r.stderr and "Traceback" not in r.stderr


def test_documented_infinity_still_validates(cli, tmp_path):
    """beta1: .inf (the plain mean: MInTRL) is kept; nan is still refused there."""
    r = _validate(cli, tmp_path, "specs/mintrl.yaml")
    assert r.exit_code == 0, r.stderr
    r = _validate(cli, tmp_path, "specs/oapl.yaml", "objective.beta1=.inf")
    assert r.exit_code == 0, r.stderr
    r = _validate(cli, tmp_path, "specs/oapl.yaml", "objective.beta1=nan")
    assert r.exit_code == 2 and "objective.beta1" in r.stderr, r.stderr


def test_finite_numbers_still_validate(cli, tmp_path):
    r = _validate(cli, tmp_path, "specs/grpo.yaml", "objective.norm_const=1024", "sources.verifier.success_threshold=1")
    assert r.exit_code == 0, r.stderr


# -------------------------------------------------------------- numbers as YAML 1.2 reads them, not YAML 1.1 (issue 17)


@pytest.mark.parametrize("text, path, expected", [
    ("train: {steps: true}\n", "train.steps", "got true"),
    ("train: {steps: 1:30}\n", "train.steps", "'1:30'"),
    ("train: {steps: yes}\n", "train.steps", "'yes'"),
    ("train: {prompts_per_step: 010}\n", None, None),  # decimal 10, not YAML 1.1 octal 8
    ("train: {steps: " + "9" * 5000 + "}\n", "train.steps", "5000 digits"),
])
def test_yaml_1_1_coercions_are_not_applied(tmp_path, text, path, expected):
    spec = tmp_path / "spec.yaml"
    spec.write_text(HEAD + text)
    r = cli("validate", spec)
    if path is None:
        assert r.exit_code == 0 and validate_file(spec).spec.train.prompts_per_step == 10
    else:
        assert r.exit_code == 2 and path in r.stderr and expected in r.stderr, r.stderr
