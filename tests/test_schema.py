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
from composer.cli import main
from composer.loader import load_spec
from composer.schema import spec_schema

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
