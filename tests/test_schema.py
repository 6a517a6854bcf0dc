"""The committed JSON Schema: generated (never stale), built-in kinds only, and it accepts every spec."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner
from jsonschema import Draft202012Validator

from composer import registry
from composer.cli.main import main
from composer.lang.loader import load_spec
from composer.lang.schema import spec_schema

REPO = Path(__file__).resolve().parent.parent
SCHEMA_FILE = REPO / "schemas" / "spec.schema.json"
SPECS = sorted((REPO / "specs").glob("*.yaml")) + sorted((REPO / "specs" / "hybrids").glob("*.yaml"))


def _looks_like_spec(path: Path) -> bool:
    data = yaml.safe_load(path.read_text())
    return isinstance(data, dict) and "name" in data and bool({"signal", "terms", "extends"} & set(data))


EXAMPLE_SPECS = [p for p in sorted((REPO / "examples").rglob("*.yaml")) if _looks_like_spec(p)]
SCHEMA_LINE = "# yaml-language-server: $schema="


def _id(p: Path) -> str:
    return str(p.relative_to(REPO))


@pytest.fixture(scope="module")
def validator():
    schema = json.loads(SCHEMA_FILE.read_text())
    Draft202012Validator.check_schema(schema)
    return Draft202012Validator(schema)


def _uses_plugins(data) -> bool:
    return isinstance(data, dict) and bool(data.get("plugins"))


def test_committed_schema_is_not_stale(tmp_path):
    out = tmp_path / "spec.schema.json"
    r = CliRunner().invoke(main, ["schema", "--out", str(out)])
    assert r.exit_code == 0, r.output
    assert out.read_text() == SCHEMA_FILE.read_text(), \
        "schemas/spec.schema.json is stale: regenerate it with `composer schema`"


def test_schema_covers_builtin_kinds_only():
    text = SCHEMA_FILE.read_text()
    for section in registry.SECTIONS:
        for kind, cls in registry.kinds(section).items():
            if cls.plugin:
                assert f'"{kind}"' not in text, f"plugin kind {kind} leaked into the committed schema"
            else:
                assert f'"{kind}"' in text, f"built-in kind {kind} missing from the schema"


def test_schema_is_2020_12_and_strict():
    schema = json.loads(SCHEMA_FILE.read_text())
    assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    assert schema["additionalProperties"] is False and schema["required"] == ["name"]
    assert schema == json.loads(json.dumps(spec_schema()))  # plain JSON: no NaN/Infinity literals
    assert "Infinity" not in json.dumps(schema).replace('"Infinity"', "")


@pytest.mark.parametrize("path", SPECS + EXAMPLE_SPECS, ids=_id)
def test_every_spec_passes_the_json_schema(path, validator):
    raw = yaml.safe_load(path.read_text())
    if _uses_plugins(raw):
        pytest.skip("uses a plugin kind; the committed schema covers built-in kinds only")
    if "extends" not in raw:  # a file on its own, as an editor sees it (`.inf` loads as a float)
        errors = [e.message for e in validator.iter_errors(raw)]
        assert not errors, errors
    merged = load_spec(path).data  # and after `extends`
    errors = [f"{list(e.absolute_path)}: {e.message}" for e in validator.iter_errors(merged)]
    assert not errors, errors


def test_inf_is_a_number_for_the_schema(validator):
    data = load_spec(REPO / "specs" / "mintrl.yaml").data
    assert data["objective"]["beta1"] == math.inf
    assert not list(validator.iter_errors(data))


@pytest.mark.parametrize("mutate, where", [
    (lambda d: d.update(trian={"steps": 3}), "trian"),
    (lambda d: d["sources"]["verifier"].update(verifer="math"), "verifer"),
    (lambda d: d["objective"].update(kind="gpro"), "gpro"),
    (lambda d: d["rollout"].update(samples_per_prompt="many"), "many"),
    (lambda d: d.pop("name"), "name"),
], ids=["unknown-top-key", "unknown-component-key", "bad-kind", "wrong-type", "missing-name"])
def test_broken_specs_fail_the_json_schema_too(mutate, where, validator):
    data = load_spec(REPO / "specs" / "grpo.yaml").data
    mutate(data)
    errors = list(validator.iter_errors(data))
    assert errors
    assert any(where in e.message or where in json.dumps(list(e.absolute_path)) or
               any(where in c.message for c in e.context) for e in errors)


@pytest.mark.parametrize("path", SPECS + EXAMPLE_SPECS, ids=_id)
def test_first_line_points_at_the_schema(path):
    first = path.read_text().splitlines()[0]
    assert first.startswith(SCHEMA_LINE), f"{path}: first line must be `{SCHEMA_LINE}<relative path>`"
    target = (path.parent / first[len(SCHEMA_LINE):].strip()).resolve()
    assert target == SCHEMA_FILE.resolve(), f"{path}: the schema line points at {target}"


# ------------------------------------------------------------------------------------------ phases and stages
# Typed as partial specs: an editor completes and checks inside them (before: free-form objects).

STAGED = """name: staged
sources:
  verifier: {kind: outcome_reward}
signal: {kind: reward, source: verifier}
objective: {kind: grpo}
stages:
  - name: a
    objective: {clip_hgih: 0.3}
    train: {steps: 2, lrr: 3}
  - name: b
    rollout: {guide: {kind: prefx}}
    objectiv: {kind: grpo}
    train: {steps: 2}
phases:
  - {until: 2, train: {steps: 3}}
  - {until: 4, sync: {evry: 2}, objective: {kind: grpo, loss_tokns: [policy]}}
"""


def _unexpected(e) -> tuple:
    """The path of the key an error is about: the object's path plus the unexpected or misspelt key."""
    import re

    m = re.search(r"\('([^']+)' was unexpected\)|^'([^']+)' is not one of", e.message)
    key = (m.group(1) or m.group(2)) if m else None
    path = tuple(e.absolute_path)
    return path + (key,) if key and e.validator in ("additionalProperties", "enum") and path[-1:] != ("kind",) \
        else path


def test_typos_inside_stages_and_phases_fail_the_json_schema_at_their_line(tmp_path, validator):
    from jsonschema.exceptions import best_match

    spec = tmp_path / "staged.yaml"
    spec.write_text(STAGED)
    loaded = load_spec(spec)
    lines = STAGED.splitlines()
    errors = list(validator.iter_errors(loaded.data))
    found = {}
    for e in errors:
        best = best_match([e])
        path = _unexpected(best)
        found[path] = (loaded.locate(path).line, best.message)
    want = {  # path -> the line holding the typo
        ("stages", 0, "objective", "clip_hgih"): 8,
        ("stages", 0, "train", "lrr"): 9,
        ("stages", 1, "rollout", "guide", "kind"): 11,
        ("stages", 1, "objectiv"): 12,
        ("phases", 0, "train", "steps"): 15,
        ("phases", 1, "sync", "evry"): 16,
        ("phases", 1, "objective", "loss_tokns"): 16,
    }
    for path, line in want.items():
        assert path in found, (path, found)
        assert found[path][0] == line, (path, found[path], lines[line - 1])
    assert "'prefx' is not one of ['intervention', 'none', 'prefix', 'traces']" in found[("stages", 1, "rollout", "guide", "kind")][1]


def test_a_wrong_field_of_a_kind_is_named_not_any_of(validator):
    data = load_spec(REPO / "specs" / "grpo.yaml").data
    data["objective"]["clip_hgih"] = 0.3
    data["rollout"]["guide"] = {"kind": "intervention", "judge": "x", "review": "chunks"}
    messages = sorted(e.message for e in validator.iter_errors(data))
    assert messages == ["'chunks' is not one of ['chunk', 'end']",
                        "Additional properties are not allowed ('clip_hgih' was unexpected)"]


def test_component_unions_carry_kind_enum_and_discriminator_mapping():
    schema = json.loads(SCHEMA_FILE.read_text())
    objective = schema["properties"]["objective"]
    assert objective["type"] == ["object", "null"]  # optional: a stage-only spec has none at the top
    kinds = sorted(k for k, c in registry.kinds("objective").items() if not c.plugin)
    assert objective["required"] == ["kind"] and sorted(objective["properties"]["kind"]["enum"]) == kinds
    assert sorted(objective["discriminator"]["mapping"]) == kinds
    assert all(set(step) == {"if", "then"} for step in objective["allOf"])
    assert "oneOf" not in json.dumps(schema)  # no "not valid under any of the given schemas" for a wrong kind


def test_a_partial_component_may_leave_kind_out(validator):
    data = load_spec(REPO / "specs" / "mintrl.yaml").data
    data["phases"][1]["objective"] = {"beta2": 0.01}  # patches the base spec's advantage_regression
    assert not list(validator.iter_errors(data))
    data["phases"][1]["objective"] = {"beta2": "big"}
    assert list(validator.iter_errors(data))


def test_validation_of_stages_is_unchanged(tmp_path):
    """The schema got types; `composer validate` still merges each stage and names it."""
    spec = tmp_path / "staged.yaml"
    spec.write_text(STAGED.split("phases:")[0].replace("    objectiv: {kind: grpo}\n", ""))
    r = CliRunner().invoke(main, ["validate", str(spec)])
    assert r.exit_code == 2
    assert f"{spec}:8:17: error: stages[0].objective.clip_hgih: in stage 'a': unknown key 'clip_hgih' in the grpo " \
           "objective" in r.output
    assert f"{spec}:11:23: error: stages[1].rollout.guide.kind: in stage 'b': unknown kind 'prefx'" in r.output
