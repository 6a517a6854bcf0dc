"""`composer validate`: every committed spec validates; every broken spec fails with a located, hinted message.

The table below has one case per semantic rule of composer/checks/rules.py (a test checks that none is
missing) and per error class of the YAML, schema and graph layers. Each case checks exit code 2 (0
for warnings), the `file:LINE:COL: error: dotted.path: ` line, a fragment of the message, and a hint.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml
from _helpers import cli

from composer.lang import loader
from composer.checks import rules
from composer.errors import SpecError
from composer.checks.validate import validate_file

REPO = Path(__file__).resolve().parent.parent
PLUGIN_SRC = [str(p) for p in sorted((REPO / "examples").glob("*/src"))]


def _is_spec(path: Path) -> bool:
    """A YAML file under examples/ is a spec if it says so (schema line) or looks like one."""
    text = path.read_text()
    if "spec.schema.json" in (text.splitlines() or [""])[0]:
        return True
    data = yaml.safe_load(text)
    return isinstance(data, dict) and "name" in data and bool({"signal", "terms", "extends"} & set(data))


SPECS = (sorted((REPO / "specs").glob("*.yaml")) + sorted((REPO / "specs" / "hybrids").glob("*.yaml"))
         + sorted((REPO / "specs" / "methods").glob("*.yaml")))
EXAMPLE_SPECS = [p for p in sorted((REPO / "examples").rglob("*.yaml")) if _is_spec(p)]
ALL_SPECS = SPECS + EXAMPLE_SPECS


def _id(p: Path) -> str:
    return str(p.relative_to(REPO))


def test_the_nine_methods_are_there():
    names = {p.stem for p in (REPO / "specs").glob("*.yaml")}
    assert {"sft", "grpo", "opd", "opsd", "sdpo", "pope", "int", "oapl", "mintrl"} <= names
    assert len(list((REPO / "specs" / "hybrids").glob("*.yaml"))) >= 1


@pytest.mark.parametrize("path", ALL_SPECS, ids=_id)
def test_every_spec_validates(path, cli):
    data = yaml.safe_load(path.read_text())
    if data.get("plugins"):  # third-party kinds: import them in a fresh process, not into this one's registry
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(PLUGIN_SRC + [os.environ.get("PYTHONPATH", "")])}
        r = subprocess.run([sys.executable, "-m", "composer.cli.main", "validate", str(path), "--allow-plugins"], capture_output=True,
                           text=True, env=env, cwd=REPO)
        assert r.returncode == 0, r.stderr
        assert "error" not in r.stderr
        return
    r = cli("validate", path)
    assert r.exit_code == 0, r.stderr
    assert f"{path}: ok" in r.stdout
    if path.is_relative_to(REPO / "specs"):
        assert "warning" not in r.stderr, "the committed methods should not need warnings"


def test_validate_many_files_reports_each(cli, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\nsignal: {kind: reward, source: nope}\nobjective: {kind: grpo}\n")
    r = cli("validate", REPO / "specs/grpo.yaml", bad, REPO / "specs/sft.yaml")
    assert r.exit_code == 2
    assert "2 valid, 1 invalid" in r.stdout
    assert f"{bad}:2:" in r.stderr


# ------------------------------------------------------------------------------------------ the table

HEAD = """\
name: broken
sources:
  verifier: {kind: outcome_reward}
"""  # lines 1-3; cases continue at line 4
GRPO = "signal: {kind: reward, source: verifier}\nobjective: {kind: grpo}\n"


@dataclass
class Case:
    id: str
    text: str
    path: str | None  # dotted field path in the message; None for errors about the file as a whole
    line: int
    fragment: str  # somewhere in the message or hint
    rule: str = ""  # the semantic rule that must fire
    files: dict = field(default_factory=dict)  # other files next to spec.yaml
    overrides: list = field(default_factory=list)
    where: str = ""  # the file the location names, if not spec.yaml
    exit: int = 2


CASES = [
    # ---- layer 1: YAML
    Case("yaml_syntax_tab", "name: x\nrollout:\n\tsamples_per_prompt: 4\n", None, 3, "tabs"),
    Case("yaml_syntax_unclosed", "name: x\nsources: {verifier: [1,\n", None, 3, "YAML syntax"),
    Case("python_tag_scalar", HEAD + "signal: {kind: reward, source: verifier}\n"
         "objective: {kind: grpo, clip: !!python/name:os.system }\n", "objective.clip", 5, "Python object tags"),
    Case("python_tag_apply", HEAD + GRPO + "summary: !!python/object/apply:os.system [\"echo pwned\"]\n",
         "summary", 6, "unsupported tag"),
    Case("duplicate_key", HEAD + GRPO + "train: {steps: 10}\ntrain: {steps: 20}\n", "train", 7,
         "duplicate key 'train' (first at line 6)"),
    Case("not_a_mapping", "- name: x\n- sources: {}\n", None, 1, "a spec is a mapping"),
    Case("not_utf8", "name: x\nsummary: caf\xe9\n", None, 2, "not UTF-8"),
    Case("control_character", "name: x\nsummary: a\x01b\n", None, 2, "not allowed in YAML"),
    Case("bad_explicit_tag", HEAD + GRPO + "sync: {every: !!int often}\n", "sync.every", 6, "cannot be read as int"),
    Case("alias_bomb", "a: &a [x, x, x, x, x, x, x, x, x, x]\nb: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a, *a]\n"
         "c: &c [*b, *b, *b, *b, *b, *b, *b, *b, *b, *b]\nd: &d [*c, *c, *c, *c, *c, *c, *c, *c, *c, *c]\n"
         "e: &e [*d, *d, *d, *d, *d, *d, *d, *d, *d, *d]\nname: x\n", "d", 4, "alias bomb"),
    Case("alias_to_itself", "name: x\nsummary: &s [*s]\n", None, 2, "refers to the node that contains it"),
    Case("too_deep", "name: x\nsummary: " + "[" * 80 + "]" * 80 + "\n", None, 2, "nesting deeper than 64 levels"),
    Case("extends_cycle", "name: a\nextends: b.yaml\n" + GRPO, "extends", 3,
         "forms a cycle: spec.yaml -> b.yaml -> spec.yaml", files={"b.yaml": "name: b\n\nextends: spec.yaml\n"},
         where="{dir}/b.yaml"),
    Case("extends_missing", "name: a\nextends: grpo.yml\n", "extends", 2, "did you mean 'grpo.yaml'?",
         files={"grpo.yaml": "name: g\n"}),
    Case("extends_not_a_path", "name: a\nextends: [grpo.yaml]\n", "extends", 2, "takes a path"),
    Case("override_wrong_type", HEAD + GRPO, "train.steps", 1, "valid integer", overrides=["train.steps=abc"],
         where="<override 'train.steps=abc'>"),
    Case("override_unknown_section", HEAD + GRPO, "trian", 1, "did you mean 'train'?", overrides=["trian.steps=3"],
         where="<override 'trian.steps=3'>"),
    Case("override_unparsable", HEAD + GRPO, None, 1, "cannot parse override", overrides=["train.steps=[1"],
         where="<override 'train.steps=[1'>"),
    # ---- layer 2: schema
    Case("unknown_key_did_you_mean", HEAD.replace("outcome_reward}", "outcome_reward, verifer: math}") + GRPO,
         "sources.verifier.verifer", 3, "did you mean 'verifier'?"),
    Case("unknown_top_level_key", HEAD + GRPO + "trian: {steps: 3}\n", "trian", 6, "did you mean 'train'?"),
    Case("bad_kind_lists_kinds", HEAD.replace("outcome_reward", "outcome_rewrd") + GRPO, "sources.verifier.kind", 3,
         "Valid kinds: feedback, oracle, outcome_reward, policy_model, reference_solution, reward_model, overlong_penalty, length_penalty, sibling_success"),
    Case("missing_kind", HEAD + "signal: {source: verifier}\nobjective: {kind: grpo}\n", "signal", 4,
         "missing `kind`"),
    Case("missing_required_field", HEAD + "  teacher: {kind: policy_model}\n" + GRPO, "sources.teacher.model", 4,
         "missing required field 'model'"),
    Case("missing_name", "sources: {}\n", "name", 1, "missing required field 'name'"),
    Case("wrong_type", HEAD + GRPO + "rollout: {samples_per_prompt: many}\n", "rollout.samples_per_prompt", 6,
         "valid integer"),
    Case("out_of_range", HEAD + GRPO + "train: {steps: 0}\n", "train.steps", 6, "greater than or equal to 1"),
    Case("bad_literal", HEAD + "  teacher: {kind: policy_model, model: big}\n"
         "signal: {kind: distillation, teacher: teacher}\nobjective: {kind: divergence, measure: kl}\n",
         "objective.measure", 6, "'reverse_kl', 'forward_kl' or 'jsd'"),
    Case("bad_literal_in_list", HEAD + "signal: {kind: reward, source: verifier}\n"
         "objective: {kind: grpo, loss_tokens: [polcy]}\n", "objective.loss_tokens[0]", 5, "did you mean 'policy'?"),
    Case("section_not_a_mapping", HEAD + "signal: {kind: reward, source: verifier}\nobjective: grpo\n",
         "objective", 5, "write `objective: {kind: grpo}`"),
    Case("bad_name", HEAD.replace("name: broken", "name: My Method") + GRPO, "name", 1, "pattern"),
    Case("nan", HEAD + GRPO + "train: {lr: .nan}\n", "train.lr", 6, "not a number"),
    Case("phase_unknown_key", HEAD + GRPO + "train: {steps: 20}\nphases:\n  - {until: 10, rollout: {temprature: 2}}\n"
         "  - {until: 20}\n", "phases[0].rollout.temprature", 8, "did you mean 'temperature'?"),
    Case("stage_wrong_type", HEAD + GRPO + "stages:\n  - {name: a, train: {steps: lots}}\n",
         "stages[0].train.steps", 7, "valid integer"),
    Case("plugin_missing", HEAD + GRPO + "plugins: [no_such_composer_plugin]\n", "plugins[0]", 6,
         "--allow-plugins"),  # not imported unless allowed; with the flag: "cannot be imported" (test_plugins)
    # ---- layer 3: graph
    Case("unknown_source_did_you_mean", HEAD + "signal: {kind: reward, source: verifer}\nobjective: {kind: grpo}\n",
         "signal.source", 4, "did you mean 'verifier'?"),
    Case("wrong_kind_at_edge_end", HEAD + "  reference: {kind: reference_solution}\n"
         "rollout: {guide: {kind: intervention, judge: reference}}\n"
         "signal: {kind: reward, source: verifier}\nobjective: {kind: advantage_regression}\n",
         "rollout.guide.judge", 5, "'reference' is a reference_solution source; judge must be policy_model or oracle"),
    Case("prefix_guide_on_non_reference", HEAD + "rollout: {guide: {kind: prefix, reference: verifier}}\n" + GRPO,
         "rollout.guide.reference", 4, "reference must be reference_solution"),
    Case("context_wrong_kind", HEAD + "  teacher: {kind: policy_model, model: self, context: [verifier]}\n"
         "signal: {kind: distillation, teacher: teacher}\nobjective: {kind: divergence}\n",
         "sources.teacher.context[0]", 4, "context must be reference_solution or feedback or sibling_success"),
    Case("needs_nothing_provides", HEAD + "  fb: {kind: feedback, from: self}\n"
         "  teacher: {kind: policy_model, model: self, context: [fb]}\n"
         "signal: {kind: distillation, teacher: teacher}\nobjective: {kind: divergence}\n",
         "sources.fb", 4, "feedback needs sequence_reward, which nothing it refers to provides"),
    Case("staged_base_is_checked_too", HEAD + "  reference: {kind: reference_solution}\n"
         "signal: {kind: distillation, teacher: verifier}\nobjective: {kind: grpo}\n"
         "stages:\n  - {name: sft, signal: {kind: sft, target: reference}, objective: {kind: cross_entropy}, train: {steps: 2}}\n",
         "signal.teacher", 5, "teacher must be policy_model"),  # found by the fuzzer: it used to crash a rule
    Case("unused_source_is_a_warning", HEAD + "  reference: {kind: reference_solution}\n" + GRPO,
         "sources.reference", 4, "declared but nothing reads it", exit=0),
    # ---- layer 4: method semantics (one per rule)
    Case("signal_and_objective", HEAD + GRPO + "terms:\n  - {signal: {kind: reward, source: verifier}, "
         "objective: {kind: grpo}}\n", "terms", 6, "both `terms` and `signal`", rule="signal_and_objective"),
    Case("no_objective", HEAD + "signal: {kind: reward, source: verifier}\n", "objective", 1, "no `objective`",
         rule="signal_and_objective"),
    Case("divergence_on_reward", HEAD + "signal: {kind: reward, source: verifier}\nobjective: {kind: divergence}\n",
         "objective.kind", 5, "needs teacher_logprobs", rule="objective_reads_its_signal"),
    Case("grpo_on_intervention_tokens", HEAD + "  judge: {kind: oracle}\n"
         "rollout: {guide: {kind: intervention, judge: judge}}\nsignal: {kind: reward, source: verifier}\n"
         "objective: {kind: grpo, loss_tokens: [policy, guide_intervention]}\n", "objective.loss_tokens", 7,
         "advantage_regression", rule="policy_gradient_on_guide_tokens"),
    Case("gate_row_fact_on_sft", HEAD + "  reference: {kind: reference_solution}\nterms:\n"
         "  - {signal: {kind: reward, source: verifier}, objective: {kind: grpo}}\n"
         "  - {signal: {kind: sft, target: reference}, objective: {kind: cross_entropy}, gate: {outcome: failure}}\n",
         "terms[1].gate.outcome", 7, "group_success_at_most", rule="term_gates"),
    Case("filter_source_gives_no_reward", HEAD + "  reference: {kind: reference_solution}\n"
         "rollout: {filter: {equal_groups: drop, source: reference}}\n" + GRPO, "rollout.filter.source", 5,
         "needs a reward source", rule="rollout_filter"),
    Case("reward_plus_not_a_reward", HEAD + "  reference: {kind: reference_solution}\n"
         "signal: {kind: reward, source: verifier, plus: {reference: 1.0}}\nobjective: {kind: grpo}\n",
         "signal.plus.reference", 5, "gives no reward per rollout", rule="reward_parts_are_rewards"),
    Case("phase_partial_term", HEAD + "rollout: {samples_per_prompt: 4}\nterms:\n"
         "  - {signal: {kind: reward, source: verifier}, objective: {kind: grpo}}\n"
         "phases:\n  - {until: 5}\n  - until: 10\n    terms:\n      - objective: {clip: 0.3}\ntrain: {steps: 10}\n",
         "phases[1].terms[0].signal", 11, "missing required field 'signal'"),
    Case("gkd_sampled_on_references", HEAD + "  teacher: {kind: policy_model, model: t}\n  ref: {kind: reference_solution}\n"
         "signal: {kind: distillation, teacher: teacher, off_policy: reference, reference: ref, lambda: 0.5}\n"
         "objective: {kind: divergence, loss_tokens: [policy, demonstration]}\n", "objective.estimator", 7,
         "use estimator: full or top_k", rule="policy_gradient_on_guide_tokens"),
    Case("gkd_references_untrained", HEAD + "  teacher: {kind: policy_model, model: t}\n  ref: {kind: reference_solution}\n"
         "signal: {kind: distillation, teacher: teacher, off_policy: reference, reference: ref, lambda: 0.5}\n"
         "objective: {kind: divergence, estimator: full}\n", "objective.loss_tokens", 7,
         "add demonstration", rule="off_policy_sequences_trained"),
    Case("grpo_on_trace_tokens_without_a_weight", HEAD + "  ref: {kind: reference_solution}\n"
         "rollout: {guide: {kind: traces, source: ref}}\nsignal: {kind: reward, source: verifier}\n"
         "objective: {kind: grpo, loss_tokens: [policy, demonstration]}\n", "objective.loss_tokens", 7,
         "off_policy_weight: {kind: shaped, gamma: 0.1}", rule="policy_gradient_on_guide_tokens"),
    Case("traces_fill_the_group", HEAD + "  ref: {kind: reference_solution}\n"
         "rollout: {samples_per_prompt: 2, guide: {kind: traces, source: ref, per_group: 2}}\n"
         "signal: {kind: reward, source: verifier}\n"
         "objective: {kind: grpo, loss_tokens: [policy, demonstration], off_policy_weight: {kind: shaped}}\n",
         "rollout.guide.per_group", 5, "no row is the policy's own rollout", rule="traces_fit"),
    Case("trace_rows_untrained", HEAD + "  ref: {kind: reference_solution}\n"
         "rollout: {guide: {kind: traces, source: ref}}\n" + GRPO, "objective.loss_tokens", 7,
         "never train", rule="trace_rows_trained"),
    Case("lagged_grpo", HEAD + GRPO + "sync: {every: 4}\n", "sync.every", 6, "assumes on-policy data",
         rule="lag_needs_correction"),
    Case("clear_buffer_without_reuse", HEAD + "signal: {kind: reward, source: verifier}\n"
         "objective: {kind: advantage_regression}\nsync: {every: 4, clear_buffer: true}\n", "sync.clear_buffer", 6,
         "does nothing without sync.reuse", rule="buffer_needs_reuse"),
    Case("control_baseline_without_controls", HEAD + "  judge: {kind: oracle}\n"
         "rollout: {guide: {kind: intervention, judge: judge}}\nsignal: {kind: reward, source: verifier}\n"
         "objective: {kind: advantage_regression, baseline: control}\n", "objective.baseline", 7,
         "control_samples: 0", rule="control_baseline_needs_controls"),
    Case("control_baseline_all_guided", HEAD + "  reference: {kind: reference_solution}\n"
         "rollout: {guide: {kind: prefix, reference: reference, guided_fraction: 1}}\n"
         "signal: {kind: reward, source: verifier}\nobjective: {kind: advantage_regression, baseline: control}\n",
         "objective.baseline", 7, "every prompt is guided", rule="control_baseline_needs_controls"),
    Case("control_samples_too_many", HEAD + "  judge: {kind: oracle}\n"
         "rollout:\n  samples_per_prompt: 8\n  guide: {kind: intervention, judge: judge, control_samples: 8}\n"
         "signal: {kind: reward, source: verifier}\nobjective: {kind: advantage_regression}\n",
         "rollout.guide.control_samples", 7, "must be less than samples_per_prompt", rule="control_samples_fit"),
    Case("one_sample_group_baseline", HEAD + GRPO + "rollout: {samples_per_prompt: 1}\n",
         "rollout.samples_per_prompt", 6, "every advantage is zero", rule="group_baseline_needs_groups"),
    Case("guided_sft_without_guide", HEAD.replace("verifier: {kind: outcome_reward}", "reference: "
         "{kind: reference_solution}") + "signal: {kind: sft, target: guided}\nobjective: {kind: cross_entropy}\n",
         "signal.target", 4, "needs a guide", rule="guided_sft_needs_guide"),
    Case("teacher_other_tokenizer", HEAD + "  teacher: {kind: policy_model, model: big, shares_tokenizer: false}\n"
         "signal: {kind: distillation, teacher: teacher}\nobjective: {kind: divergence}\n",
         "sources.teacher.shares_tokenizer", 4, "shares_tokenizer: false", rule="teacher_shares_tokenizer"),
    Case("ema_weights_of_other_model", HEAD + "  teacher: {kind: policy_model, model: big, weights: ema}\n"
         "signal: {kind: distillation, teacher: teacher}\nobjective: {kind: divergence}\n",
         "sources.teacher.weights", 4, "applies to `model: self`", rule="self_weights_only_for_self"),
    Case("phases_not_increasing", HEAD + GRPO + "train: {steps: 100}\nphases:\n  - {until: 50}\n  - {until: 40}\n"
         "  - {until: 100}\n", "phases[1].until", 9, "not after the previous phase", rule="phases_cover_steps"),
    Case("last_phase_short", HEAD + GRPO + "train: {steps: 100}\nphases:\n  - {until: 50}\n  - {until: 80}\n",
         "phases[1].until", 9, "add `- {until: 100}`", rule="phases_cover_steps"),
    Case("phase_changes_steps", HEAD + GRPO + "train: {steps: 100}\nphases:\n  - {until: 50, train: {steps: 3}}\n"
         "  - {until: 100}\n", "phases[0].train.steps", 8, "a phase cannot change it", rule="segment_settings"),
    Case("phase_changes_seed", HEAD + GRPO + "train: {steps: 10}\nphases:\n  - {until: 5, train: {seed: 3}}\n"
         "  - {until: 10}\n", "phases[0].train.seed", 8, "setting of the whole run", rule="segment_settings"),
    Case("stage_changes_engine", HEAD + GRPO + "stages:\n  - {name: a, train: {steps: 5}, rollout: {engine: hf}}\n",
         "stages[0].rollout.engine", 7, "fixed for the run", rule="segment_settings"),
    Case("stage_without_steps", HEAD + GRPO + "stages:\n  - {name: a, train: {steps: 5}}\n  - {name: b}\n",
         "stages[1]", 8, "does not say how many steps", rule="staged_steps"),
    Case("staged_top_level_steps", HEAD + GRPO + "train: {steps: 30}\nstages:\n  - {name: a, train: {steps: 5}}\n",
         "train.steps", 6, "stages.0.train.steps=N", rule="staged_steps"),
    Case("staged_top_level_steps_override", HEAD + GRPO + "stages:\n  - {name: a, train: {steps: 5}}\n",
         "train.steps", 1, "does not apply to a staged spec", rule="staged_steps", overrides=["train.steps=3"],
         where="<override 'train.steps=3'>"),
    Case("phase_never_runs_in_the_file", HEAD + GRPO + "train: {steps: 10}\nphases:\n  - {until: 10}\n"
         "  - {until: 20}\n", "phases[1]", 9, "never runs", rule="phases_run"),
    Case("phase_cut_short_in_the_file", HEAD + GRPO + "train: {steps: 15}\nphases:\n  - {until: 10}\n"
         "  - {until: 20}\n", "phases[1].until", 9, "beyond the run's last step", rule="phases_run"),
    Case("phase_never_runs_after_a_quick_override_is_a_warning", HEAD + GRPO + "train: {steps: 20}\nphases:\n"
         "  - {until: 10}\n  - {until: 20}\n", "phases[1]", 9, "never runs", rule="phases_run",
         overrides=["train.steps=5"], exit=0),
    Case("template_unknown_field", HEAD + "  reference: {kind: reference_solution}\n  teacher: {kind: policy_model, "
         "model: self, weights: initial, context: [reference], template: \"{reference} {problem} {solution}\"}\n"
         "signal: {kind: distillation, teacher: teacher}\nobjective: {kind: divergence}\n",
         "sources.teacher.template", 5, "{solution} is not filled", rule="template_fields"),
    Case("template_format_spec_that_would_allocate", HEAD + "  reference: {kind: reference_solution}\n  teacher: "
         "{kind: policy_model, model: self, weights: initial, context: [reference], template: "
         "\"{reference:>999999999999} {problem}\"}\nsignal: {kind: distillation, teacher: teacher}\n"
         "objective: {kind: divergence}\n", "sources.teacher.template", 5, "is not a plain field"),
    Case("guided_settings_on_a_reference_target", HEAD + "  reference: {kind: reference_solution}\n"
         "signal: {kind: sft, target: reference, filter_samples: 4}\n"
         "objective: {kind: cross_entropy, loss_tokens: [demonstration]}\n", "signal", 5,
         "apply to `target: guided` only"),
    Case("template_drops_context", HEAD + "  reference: {kind: reference_solution}\n  teacher: {kind: policy_model, "
         "model: self, weights: initial, context: [reference], template: \"{problem}\"}\n"
         "signal: {kind: distillation, teacher: teacher}\nobjective: {kind: divergence}\n",
         "sources.teacher.template", 5, "would never reach the prompt", rule="template_fields"),
    Case("self_teacher_without_context", HEAD + "  teacher: {kind: policy_model, model: self}\n"
         "signal: {kind: distillation, teacher: teacher}\nobjective: {kind: divergence}\n",
         "sources.teacher", 4, "the signal is zero", rule="self_teacher_sees_something_else"),
    Case("loss_tokens_nothing_writes", HEAD + "signal: {kind: reward, source: verifier}\n"
         "objective: {kind: advantage_regression, loss_tokens: [policy, guide_intervention]}\n",
         "objective.loss_tokens", 5, "never occur in this term's batch", rule="loss_tokens_written"),
    Case("sequence_ratio_with_token_clip", HEAD + "signal: {kind: reward, source: verifier}\n"
         "objective: {kind: grpo, ratio: sequence}\n", "objective.clip_low", 5, "clip range of token-level PPO",
         rule="sequence_ratio_clip"),
    Case("dual_clip_with_cispo", HEAD + "signal: {kind: reward, source: verifier}\n"
         "objective: {kind: grpo, bound: cispo, dual_clip: 3.0}\n", "objective.dual_clip", 5, "dual_clip applies",
         rule="bound_fields"),
    Case("epochs_with_16_mixed", HEAD + GRPO + "train: {epochs: 2, precision: 16-mixed}\n", "train.precision", 6,
         "loss scaler", rule="several_updates_precision"),
    Case("freeze_policy_without_a_critic", HEAD + GRPO + "train: {freeze_policy: true}\n", "train.freeze_policy", 6,
         "no term here has a critic", rule="freeze_policy_needs_critic"),
    Case("more_mini_batches_than_groups", HEAD + GRPO + "train: {mini_batches: 9, prompts_per_step: 8}\n",
         "train.mini_batches", 6, "whole groups", rule="mini_batches_fit_groups"),
    Case("epochs_without_ratio", HEAD + "  teacher: {kind: policy_model, model: big}\n"
         "signal: {kind: distillation, teacher: teacher}\nobjective: {kind: divergence}\ntrain: {epochs: 2}\n",
         "train.epochs", 7, "no importance ratio", rule="several_updates_need_a_ratio"),
    Case("gate_the_filter_empties_is_a_warning", HEAD + "rollout: {filter: {equal_groups: drop}}\nterms:\n"
         "  - {signal: {kind: reward, source: verifier}, objective: {kind: grpo}}\n"
         "  - {name: b, signal: {kind: reward, source: verifier}, objective: {kind: grpo}, gate: {outcome: failure, "
         "sibling_success: false}}\n", "terms[1].gate", 7, "removes exactly those groups", rule="gate_under_filter",
         exit=0),
    Case("negative_term_weight_is_a_warning", HEAD + "terms:\n  - {signal: {kind: reward, source: verifier}, "
         "objective: {kind: grpo}, weight: -1}\n", "terms[0].weight", 5, "maximised", rule="term_weight_positive",
         exit=0),
    Case("phases_and_stages", HEAD + GRPO + "train: {prompts_per_step: 2}\nphases:\n  - {until: 10}\nstages:\n"
         "  - {name: a, train: {steps: 5}}\n",
         "phases", 7, "ambiguous", rule="phases_cover_steps"),
    Case("stage_names_repeat", HEAD + GRPO + "stages:\n  - {name: a, train: {steps: 5}}\n  - {name: a, train: {steps: 5}}\n",
         "stages[1].name", 8, "two stages are named 'a'", rule="stages_well_formed"),
    Case("stage_name_reads_as_an_option", HEAD + GRPO + "stages:\n  - {name: -a, train: {steps: 5}}\n",
         "stages[0].name", 7, "starts with '-'", rule="names_are_words"),
    Case("sampled_jsd", HEAD + "  teacher: {kind: policy_model, model: big}\n"
         "signal: {kind: distillation, teacher: teacher}\nobjective: {kind: divergence, measure: jsd}\n",
         "objective.estimator", 6, "reverse KL only", rule="sampled_divergence_is_reverse_kl"),
    Case("rule_in_a_stage", HEAD + GRPO + "stages:\n  - {name: a, train: {steps: 5}, sync: {every: 3}}\n",
         "stages[0].sync.every", 7, "in stage 'a': sync.every is 3", rule="lag_needs_correction"),
    Case("rule_in_terms", HEAD + "terms:\n  - {signal: {kind: reward, source: verifier}, "
         "objective: {kind: grpo, loss_tokens: [guide_prefix]}}\n", "terms[0].objective.loss_tokens", 5,
         "policy gradient", rule="policy_gradient_on_guide_tokens"),
    # ---- rollout.environment (issue 55)
    Case("environment_tokens_trained", HEAD + "rollout: {environment: {kind: tools}}\n"
         "signal: {kind: reward, source: verifier}\nobjective: {kind: grpo, loss_tokens: [policy, environment]}\n",
         "objective.loss_tokens", 6, "the environment wrote them", rule="environment_tokens_never_loss"),
    Case("environment_without_rollouts", "name: broken\nsources:\n  ref: {kind: reference_solution}\n"
         "rollout: {environment: {kind: tools}}\nsignal: {kind: sft, target: ref}\n"
         "objective: {kind: cross_entropy, loss_tokens: [demonstration]}\n",
         "rollout.environment.kind", 4, "no episode ever runs", rule="environment_fits_rollout"),
    Case("environment_feedback_without_environment", HEAD + "  fb: {kind: feedback, from: verifier, detail: environment}\n"
         + GRPO, "sources.fb.detail", 4, "it would never have a text", rule="environment_feedback_needs_environment"),
    Case("turn_reward_weight_without_turn_rewards", HEAD + "rollout: {environment: {kind: tools, turn_reward_weight: 1.0}}\n"
         + GRPO, "rollout.environment.turn_reward_weight", 4, "adds nothing", rule="turn_reward_weight_acts", exit=0),
]

LOCATED = re.compile(r"^(?P<file>.+?):(?P<line>\d+):(?P<col>\d+): (?P<sev>error|warning): (?P<rest>.*)$")


def _write(tmp_path: Path, case: Case) -> Path:
    for name, text in case.files.items():
        (tmp_path / name).write_text(text)
    spec = tmp_path / "spec.yaml"
    if "\xe9" in case.text:  # the not-UTF-8 case: latin-1 bytes
        spec.write_bytes(case.text.encode("latin-1"))
    else:
        spec.write_text(case.text)
    return spec


def _errors(stderr: str) -> list[tuple[re.Match, str]]:
    """(located line, its hint) for every diagnostic in the output."""
    lines = stderr.splitlines()
    out = []
    for i, line in enumerate(lines):
        m = LOCATED.match(line)
        if m:
            hint = lines[i + 1].strip() if i + 1 < len(lines) and lines[i + 1].startswith("    hint: ") else ""
            out.append((m, hint))
    return out


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_broken_spec(case, cli, tmp_path):
    spec = _write(tmp_path, case)
    r = cli("validate", spec, *case.overrides)
    assert r.exit_code == case.exit, r.stderr
    assert "Traceback" not in r.stderr and "internal error" not in r.stderr
    where = case.where.format(dir=tmp_path) or str(spec)
    sev = "warning" if case.exit == 0 else "error"
    found = [(m, hint) for m, hint in _errors(r.stderr)
             if m["file"] == where and int(m["line"]) == case.line and m["sev"] == sev
             and (case.path is None or m["rest"].startswith(case.path + ": "))]
    assert found, f"expected {where}:{case.line}:COL: {sev}: {case.path}: ...\n{r.stderr}"
    assert case.fragment in r.stderr, r.stderr
    for m, hint in _errors(r.stderr):  # every problem says how to fix it
        assert hint.startswith("hint: ") and len(hint) > 12, f"no hint for: {m.group(0)}"
    if case.rule and case.exit == 0:  # a warning: the spec validates, with it
        assert case.rule in {d.rule for d in validate_file(spec, case.overrides).warnings}
    elif case.rule:
        with pytest.raises(SpecError) as e:
            validate_file(spec, case.overrides)
        assert case.rule in {d.rule for d in e.value.diagnostics}


def test_every_rule_has_a_case():
    covered = {c.rule for c in CASES}
    assert set(rules.RULES) <= covered, f"add a broken-spec case for: {sorted(set(rules.RULES) - covered)}"


def test_table_is_big_enough():
    assert len(CASES) >= 25


def test_errors_of_a_layer_come_together(cli, tmp_path):
    spec = tmp_path / "spec.yaml"
    spec.write_text(HEAD + "signal: {kind: reward, source: verifier, wieght: 2}\n"
                    "objective: {kind: grpo, clip: big}\ntrain: {steps: 0}\n")
    r = cli("validate", spec)
    assert r.exit_code == 2
    paths = [m["rest"].split(":")[0] for m, _ in _errors(r.stderr)]
    assert {"signal.wieght", "objective.clip", "train.steps"} <= set(paths)


def test_errors_in_an_extended_base_point_into_the_base(cli, tmp_path):
    (tmp_path / "base.yaml").write_text("name: base\nsources:\n  verifier: {kind: outcome_reward}\n"
                                        "signal: {kind: reward, source: verifier}\nobjective: {kind: grpo}\n")
    spec = tmp_path / "spec.yaml"
    spec.write_text("name: child\nextends: base.yaml\nsync: {every: 8}\n")
    r = cli("validate", spec)
    assert r.exit_code == 2
    assert f"{spec}:3:" in r.stderr and "sync.every" in r.stderr


def test_merge_keys_let_own_keys_override(tmp_path):
    spec = tmp_path / "spec.yaml"
    spec.write_text("name: m\nsources:\n  verifier: &v {kind: outcome_reward, success_threshold: 0.2}\n"
                    "  strict: {<<: *v, success_threshold: 0.9}\n"
                    "signal: {kind: reward, source: strict}\nobjective: {kind: grpo}\n")
    v = validate_file(spec)
    assert v.spec.sources["strict"].success_threshold == 0.9
    assert v.spec.sources["verifier"].success_threshold == 0.2


# ------------------------------------------------------------------------------------------ subprocess

@pytest.mark.parametrize("case_id", ["unknown_key_did_you_mean", "lagged_grpo", "extends_cycle"])
def test_subprocess_exit_code_and_location(case_id, tmp_path):
    case = next(c for c in CASES if c.id == case_id)
    spec = _write(tmp_path, case)
    r = subprocess.run([sys.executable, "-m", "composer.cli.main", "validate", str(spec)], capture_output=True, text=True,
                       cwd=REPO)
    assert r.returncode == 2
    where = case.where.format(dir=tmp_path) or str(spec)
    assert f"{where}:{case.line}:" in r.stderr and f"{case.path}: " in r.stderr
    assert "Traceback" not in r.stderr


def test_subprocess_warning_exits_zero(tmp_path):
    case = next(c for c in CASES if c.id == "unused_source_is_a_warning")
    spec = _write(tmp_path, case)
    r = subprocess.run([sys.executable, "-m", "composer.cli.main", "validate", str(spec)], capture_output=True, text=True,
                       cwd=REPO)
    assert r.returncode == 0
    assert "warning: sources.reference" in r.stderr and f"{spec}: ok" in r.stdout


# ------------------------------------------------------------------------------------------ loader limits

def test_file_over_the_size_limit_is_refused_unread(cli, tmp_path):
    spec = tmp_path / "big.yaml"
    spec.write_text("name: x\nsummary: " + "a" * (loader.MAX_FILE_BYTES + 10) + "\n")
    r = cli("validate", spec)
    assert r.exit_code == 2
    assert f"{spec}:1:1: error: file larger than {loader.MAX_FILE_BYTES} bytes" in r.stderr


def test_alias_bomb_is_refused_before_it_is_built(tmp_path, monkeypatch):
    levels = ["a0: &a0 [lol, lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
    for i in range(1, 12):  # 10**12 nodes if expanded
        levels.append(f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]")
    spec = tmp_path / "bomb.yaml"
    spec.write_text("\n".join(levels) + "\nname: x\n")
    walked = []
    original = loader._Walker.walk
    monkeypatch.setattr(loader._Walker, "walk", lambda self, *a: walked.append(1) or original(self, *a))
    with pytest.raises(SpecError) as e:
        loader.load_spec(spec)
    d = e.value.diagnostics[0]
    assert "alias bomb" in d.message and d.location.line >= 1 and d.hint
    assert not walked, "the bomb must be measured, not expanded"


def test_a_flat_document_over_the_node_limit_is_refused(tmp_path):
    spec = tmp_path / "wide.yaml"
    spec.write_text("name: x\nsummary: [" + ", ".join(["1"] * (loader.MAX_NODES + 5)) + "]\n")
    with pytest.raises(SpecError) as e:
        loader.load_spec(spec)
    assert f"more than {loader.MAX_NODES} nodes" in e.value.diagnostics[0].message


def test_special_files_do_not_hang(cli, tmp_path):
    r = cli("validate", "/dev/zero")
    assert r.exit_code == 2 and "larger than" in r.stderr
    r = cli("validate", tmp_path)
    assert r.exit_code == 2 and "is a directory" in r.stderr
    r = cli("validate", tmp_path / "missing.yaml")
    assert r.exit_code == 2 and "no such file" in r.stderr


def test_overrides_index_lists_with_brackets_or_dots():
    """`stages[0].train.steps=1` and `stages.0.train.steps=1` say the same; each stage runs its own steps."""
    spec = REPO / "specs" / "int.yaml"
    for override in ("stages[0].train.steps=1", "stages.0.train.steps=1"):
        v = validate_file(spec, [override])
        assert [(s.name, s.start, s.end) for s in v.segments] == [("sft", 0, 1), ("rl", 1, 61)]


# ------------------------------------------------------------------------ the loader's rough edges (issue 57)

def test_a_spec_file_whose_name_holds_an_equals_sign_is_validated(cli, tmp_path):
    """Was taken as an override: nothing was checked and validate exited 0. An existing file wins."""
    spec = tmp_path / "lr=1e-4.yaml"
    spec.write_text(HEAD + GRPO + "sync: {every: 8}\n")  # a lagged GRPO: refused when it is read
    r = cli("validate", spec)
    assert r.exit_code == 2 and f"{spec}:" in r.stderr and "sync.every" in r.stderr, r.stderr
    spec.write_text(HEAD + GRPO)
    r = cli("validate", spec, "train.steps=3")
    assert r.exit_code == 0 and f"{spec}: ok" in r.stdout, r.stderr


def test_validate_with_no_spec_file_is_refused(cli, tmp_path):
    r = cli("validate", tmp_path / "missing=1.yaml")
    assert r.exit_code == 2 and "no spec file given" in r.stderr and "hint: " in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


def test_an_extends_symlink_loop_is_named(cli, tmp_path):
    """Was "internal error ... RuntimeError: Symlink loop"."""
    (tmp_path / "a.yaml").symlink_to("b.yaml")
    (tmp_path / "b.yaml").symlink_to("a.yaml")
    spec = tmp_path / "spec.yaml"
    spec.write_text("name: t\nextends: a.yaml\n")
    r = cli("validate", spec)
    assert r.exit_code == 2, r.stderr
    assert f"{spec}:2:1: error: extends: " in r.stderr and "a.yaml -> b.yaml -> a.yaml" in r.stderr, r.stderr
    assert "internal error" not in r.stderr and "hint: " in r.stderr
    r = cli("validate", tmp_path / "a.yaml")  # the spec itself a loop
    assert r.exit_code == 2 and "a loop of symbolic links: a.yaml -> b.yaml -> a.yaml" in r.stderr, r.stderr
    (tmp_path / "base.yaml").write_text(HEAD + GRPO)
    (tmp_path / "link.yaml").symlink_to("base.yaml")
    spec.write_text("name: t\nextends: link.yaml\n")
    assert cli("validate", spec).exit_code == 0  # a link that leads to a file still works


@pytest.mark.parametrize("item", ["sources={}", "train={}", "data.chat_template_kwargs={}"])
def test_an_empty_mapping_override_is_refused(cli, item):
    """`sources={}` merged nothing and said nothing; an override cannot empty a mapping, so it is refused."""
    r = cli("validate", REPO / "specs/grpo.yaml", item)
    assert r.exit_code == 2, r.stderr
    assert f"<override '{item}'>:1:1: error: " in r.stderr and "changes nothing" in r.stderr, r.stderr
    assert cli("validate", REPO / "specs/grpo.yaml", "sources.verifier={kind: outcome_reward}").exit_code == 0


def test_control_characters_of_a_spec_are_escaped_in_explain_and_validate(cli, tmp_path):
    """A carriage return, a bell and an escape sequence in `summary` (or a key) reached the terminal raw."""
    spec = tmp_path / "spec.yaml"
    spec.write_text(HEAD + 'summary: "ok\\rEVIL\\a \\x1b[31mred"\n' + GRPO)
    for fmt in ("text", "mermaid", "dot", "json"):
        r = cli("explain", spec, "--format", fmt)
        assert r.exit_code == 0, r.stderr
        assert not any(c in r.stdout for c in "\r\x07\x1b"), (fmt, r.stdout[:200])
    assert "ok\\rEVIL\\x07 \\x1b[31mred" in cli("explain", spec).stdout
    spec.write_text(HEAD + GRPO + '"bad\\x1b[2Jkey": 1\n')
    r = cli("validate", spec)
    assert r.exit_code == 2 and "\x1b" not in r.stderr and "bad\\x1b[2Jkey" in r.stderr, r.stderr


# ------------------------------------------------------------------------------ what validation refuses (issue 17)


REFUSED = {
    "steps beyond int64": ("train.steps=9223372036854775808", "train.steps"),
    "lr inf": ("train.lr=.inf", "train.lr"),
    "beta of 1": ("train.betas=[0.9,1.0]", "train.betas[1]"),
    "negative beta": ("train.betas=[-0.1,0.9]", "train.betas[0]"),
    "unknown precision": ("train.precision=33", "train.precision"),
    "unknown accelerator": ("train.accelerator=tpu", "train.accelerator"),
    "unknown strategy": ("train.strategy=ddp_magic", "train.strategy"),
    "zero devices": ("train.devices=0", "train.devices"),
    "devices mapping": ("train.devices={a:1}", "train.devices"),
    "weight decay that flips weights": ("train.weight_decay=1e300", "train.weight_decay"),
    "unknown verifier": ("sources.verifier.verifier=mathh", "sources.verifier.verifier"),
    "empty tiers": ("data.tiers=[]", "data.tiers"),
    "empty train tiers": ("data.train_tiers=[]", "data.train_tiers"),
    "tier 0": ("data.tiers=[0]", "data.tiers[0]"),
    "steps: true": ("train.steps=true", "train.steps"),
    "boolean lr": ("train.lr=false", "train.lr"),
    "huge eval samples": ("train.eval_samples=100000000000", "train.eval_samples"),
    "negative seed": ("train.seed=-1", "train.seed"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_validation_refuses_what_cannot_run(tmp_path, case):
    override, path = REFUSED[case]
    r = cli("validate", REPO / "specs/grpo.yaml", override)
    assert r.exit_code == 2 and f": error: {path}" in r.stderr, r.stderr
    assert "internal error" not in r.stderr


@pytest.mark.parametrize("name", ['a"b', "a\nb", "x\u202eevil", "A", "a b", "x];evil[", "-->"])
def test_source_names_cannot_inject_into_diagrams(tmp_path, name):
    spec = tmp_path / "spec.yaml"
    spec.write_text(f"name: x\nsources:\n  {json.dumps(name)}: {{kind: outcome_reward}}\n"
                    f"signal: {{kind: reward, source: {json.dumps(name)}}}\nobjective: {{kind: grpo}}\n")
    for fmt in ("dot", "mermaid"):
        r = cli("explain", spec, "--format", fmt)
        assert r.exit_code == 2 and "names are [a-z0-9_-]+" in r.stderr and r.stdout == ""


def test_a_fifo_spec_file_does_not_hang(tmp_path):
    fifo = tmp_path / "spec.yaml"
    os.mkfifo(fifo)
    r = cli("validate", fifo)
    assert r.exit_code == 2 and "named pipe" in r.stderr
