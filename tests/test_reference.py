"""`composer list` and docs/reference.md: every key, kind and field with its type, default and description."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest
from click.testing import CliRunner

from composer import registry
from composer.lang import reference
from composer.cli.main import main
from composer.lang.spec import spec_model

REPO = Path(__file__).resolve().parent.parent
DOC = REPO / "docs" / "reference.md"
BUILTIN_KINDS = [(s, k, c) for s in registry.SECTIONS for k, c in sorted(registry.kinds(s).items()) if not c.plugin]


def invoke(*args, columns: int = 80):
    return CliRunner(env={"COLUMNS": str(columns)}).invoke(main, [str(a) for a in args], catch_exceptions=False)


def test_committed_reference_is_not_stale(tmp_path):
    out = tmp_path / "reference.md"
    r = invoke("list", "--markdown", "--out", out)
    assert r.exit_code == 0, r.output
    assert out.read_text() == DOC.read_text(), \
        f"docs/reference.md is stale: regenerate it with `{reference.REGEN}`"


def test_reference_names_every_key_kind_and_field():
    text = DOC.read_text()
    for key in spec_model(builtins_only=True).model_fields:
        assert f"| `{key}` |" in text, f"top-level key {key} missing"
        assert key in reference.SPEC_KEYS
    for section, kind, cls in BUILTIN_KINDS:
        assert f"### `{section}/{kind}`" in text
        assert inspect.cleandoc(cls.__doc__) in text  # the whole docstring: formula and paper
        for name, f in cls.model_fields.items():
            assert f"| `{f.alias or name}` |" in text
            assert reference._md_cell(f.description) in text
    for name in registry.VERIFIERS:
        assert f"| `{name}` |" in text


def test_fields_have_type_allowed_values_and_default():
    fields = {f.name: f for f in reference.kind_entry("objective", registry.lookup("objective", "grpo")).fields}
    assert fields["kind"].default == "required" and fields["kind"].allowed == ["grpo"]
    assert (fields["clip"].type, fields["clip"].default) == ("number >= 0", "0.2")
    assert fields["clip_high"].default == "not set"
    assert fields["kl_estimator"].allowed == ["k1", "k2", "k3"] and fields["kl_estimator"].default == "k3"
    assert fields["loss_tokens"].type == "list of string" and fields["loss_tokens"].default == '["policy"]'
    assert "policy" in fields["loss_tokens"].allowed
    train = {f.name: f for f in reference.section_entry("train").fields}
    assert train["betas"].type == "list of number >= 0, < 1 exactly 2 items" and train["betas"].default == "[0.9, 0.999]"
    stage = {f.name: f for f in reference.section_entry("stages").fields}
    assert stage["objective"].type == "partial objective (`kind` optional)"
    assert "grpo" in stage["objective"].allowed
    phase = {f.name: f for f in reference.section_entry("phases").fields}
    assert phase["until"].default == "required" and phase["until"].type == "integer >= 1"


def test_list_one_kind_prints_fields_formula_and_paper():
    r = invoke("list", "objective/advantage_regression", columns=300)
    assert r.exit_code == 0, r.output
    out = r.stdout
    # rich markup would swallow the bracketed log-ratio
    assert "(beta2 * [log pi_theta(y_i|x) - log pi_anchor(y_i|x)] - (r_i - V_hat(x_i)))^2" in out
    assert "arXiv 2602.19362" in out
    assert re.search(r"beta2 +number > 0; default: 0.001", out)
    assert re.search(r"baseline +string; one of: all, control; default: all", out)
    assert "Rollouts V_hat is computed over" in out
    assert "objective/grpo" not in out  # one kind only


def test_list_wraps_and_never_truncates_at_80_columns():
    for args in (["list"], ["list", "sources/policy_model"], ["list", "--section", "objective"]):
        r = invoke(*args, columns=80)
        assert r.exit_code == 0, r.output
        assert "…" not in r.stdout
    assert "feedback_only_without_solution" in invoke("list", "sources/policy_model").stdout
    assert "sibling_success" in invoke("list").stdout


def test_list_overview_has_every_section():
    out = invoke("list", columns=200).stdout
    for key in reference.SPEC_KEYS:
        assert f"│ {key} " in out, key
    for section, kind, _ in BUILTIN_KINDS:
        assert kind in out
    assert "docs/reference.md" in out


@pytest.mark.parametrize("topic, expect", [
    ("stages", ["Fields of one stage:", "partial objective (`kind` optional)", "steps` is this stage's step count"]),
    ("phases", ["until", "integer >= 1", "(not `steps`)"]),
    ("terms", ["weight", "Several weighted signal/objective pairs"]),
    ("sync", ["every", "clear_buffer", "off_policy_ok"]),
    ("rollout", ["samples_per_prompt", "guide", "intervention, none, prefix"]),
    ("train", ["steps", "lr_schedule", "constant, cosine"]),
    ("data", ["on_bad_row", "error, skip"]),
    ("policy", ["dtype", "float32, bfloat16, float16"]),
    ("guide", ["guide/prefix", "guided_fraction"]),
    ("grpo", ["objective/grpo", "kl_estimator"]),
    ("verifiers", ["math", "code", "toy", "exact"]),
])
def test_list_topic(topic, expect):
    r = invoke("list", topic, columns=200)
    assert r.exit_code == 0, r.output
    for text in expect:
        assert text in r.stdout, (topic, text)


def test_list_markdown_of_one_topic():
    r = invoke("list", "objective/grpo", "--markdown")
    assert r.exit_code == 0
    assert r.stdout.startswith("## `objective/grpo`")
    assert "| `clip` | number >= 0 |  | `0.2` | Symmetric ratio clip epsilon. |" in r.stdout


@pytest.mark.parametrize("args, message", [
    (["list", "objectiv"], "hint: did you mean 'objective'?"),
    (["list", "objective/gpro"], "hint: did you mean 'grpo'?"),
    (["list", "train/x"], "'train' has no kinds"),
    (["list", "--out", "x.md"], "--out needs --markdown"),
])
def test_list_errors(args, message):
    r = invoke(*args)
    assert r.exit_code == 2
    assert message in r.stderr and "Traceback" not in r.output


def test_markdown_cells_stay_one_line_and_escaped():
    assert reference._md_cell("a | b\nc <x> `<y>`") == "a \\| b c &lt;x> `<y>`"
    columns = None
    for line in DOC.read_text().splitlines():
        if not line.startswith("|"):
            columns = None
            continue
        pipes = len(re.findall(r"(?<!\\)\|", line))
        columns = columns or pipes  # the header row
        assert pipes == columns, f"a table row with a stray `|`: {line}"


def test_list_markdown_unwritable_out_is_an_error(tmp_path):
    r = invoke("list", "--markdown", "--out", tmp_path / "no" / "such" / "\0dir" / "reference.md")
    assert r.exit_code == 2 and "cannot write the reference" in r.stderr and "Traceback" not in r.output
