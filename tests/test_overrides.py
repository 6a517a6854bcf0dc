"""Overrides and `extends` (issues 29 and 43): an override's value is read as the same text in a spec file would
be (YAML 1.2: no octal `010`, no base-60 `1:30`, no boolean `yes`), a brace mapping written without spaces or a
`{placeholder}` left unquoted says how to write it, `extends` is no override, and a base named through a link
is found next to the real file.
"""

from __future__ import annotations

import pytest
from _helpers import HEAD, REPO, cli

# ------------------------------------------------------------------------------ values read as in a file (issue 29)


@pytest.mark.parametrize("override, path, expected", [
    ("train.steps=010", ("train", "steps"), 10),  # YAML 1.1 would read octal 8
    ("train.seed=0o17", ("train", "seed"), 15),
    ("train.lr=1e-3", ("train", "lr"), 0.001),  # YAML 1.1 would read the string '1e-3'
    ("data.system_prompt=yes", ("data", "system_prompt"), "yes"),  # YAML 1.1 would read True
    ("name=on", ("name",), "on"),
])
def test_overrides_read_values_as_files_do(override, path, expected):
    from composer.lang.loader import load_spec

    data = load_spec(REPO / "specs" / "grpo.yaml", [override]).data
    for p in path:
        data = data[p]
    assert data == expected and type(data) is type(expected)


def test_a_base_60_override_is_refused_like_in_a_file(tmp_path):
    r = cli("validate", REPO / "specs" / "grpo.yaml", "train.steps=1:30")  # YAML 1.1 would read 90
    assert r.exit_code == 2 and "'1:30'" in r.stderr
    spec = tmp_path / "s.yaml"
    spec.write_text(f"extends: {REPO / 'specs' / 'grpo.yaml'}\ntrain: {{steps: 1:30}}\n")
    assert cli("validate", spec).exit_code == 2


# ------------------------------------------------------------------------------ braces (issues 29, 43)


def test_a_brace_override_without_spaces_says_so():
    """`{kind:linear,...}` is YAML for one key `kind:linear` with no value: the error says where the space goes
    (it was `objective.kl_coef.Schedule: missing required field 'Schedule'`)."""
    r = cli("validate", REPO / "specs" / "grpo.yaml", "objective.kl_coef={kind:linear,start:0.01,end:0,steps:10}")
    assert r.exit_code == 2 and "`kind:linear` is read as one key" in r.stderr and "write `kind: linear`" in r.stderr
    assert cli("validate", REPO / "specs" / "grpo.yaml",
               "objective.kl_coef={kind: linear, start: 0.01, end: 0, steps: 10}").exit_code == 0
    assert cli("validate", REPO / "specs" / "grpo.yaml", "summary=a:b").exit_code == 0  # a plain value keeps its colon


def test_an_unquoted_brace_override_says_to_quote_it():
    """Before: only "Input should be a valid string" (YAML reads {prompt} as the mapping {prompt: null})."""
    r = cli("validate", "specs/grpo.yaml", "data.prompt_template={prompt}")
    assert r.exit_code == 2
    assert "is a mapping, not text" in r.stderr and "'data.prompt_template=\"{prompt}\"'" in r.stderr, r.stderr
    assert cli("validate", "specs/grpo.yaml", 'data.prompt_template="{prompt}"').exit_code == 0


# ------------------------------------------------------------------------------ extends (issue 29)


def test_extends_is_not_an_override():
    r = cli("validate", REPO / "specs" / "grpo.yaml", "extends=sft.yaml")
    assert r.exit_code == 2 and "`extends` cannot be overridden" in r.stderr


def test_extends_through_a_link_is_relative_to_the_real_file(tmp_path):
    from composer.lang.loader import load_spec

    real, elsewhere = tmp_path / "real", tmp_path / "elsewhere"
    real.mkdir()
    elsewhere.mkdir()
    (real / "base.yaml").write_text(HEAD + "train: {steps: 7}\n")
    (elsewhere / "base.yaml").write_text(HEAD + "train: {steps: 99}\n")  # next to the link: not the author's base
    (real / "child.yaml").write_text("extends: base.yaml\nname: child\n")
    (elsewhere / "child.yaml").symlink_to(real / "child.yaml")
    assert load_spec(elsewhere / "child.yaml").data["train"]["steps"] == 7
