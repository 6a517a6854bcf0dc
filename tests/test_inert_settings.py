"""Settings that can never act are refused at validation (composer/checks/inert.py, issue 40 part 3).

One case per refusal: `composer validate` exits 2 (0 for a warning), the located line names the setting's path,
the message says why with a fragment written here by hand, a hint follows, and no traceback. Settings that do act
(the same setting where something reads it) are checked to validate, so that no refusal is vacuous.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from composer.checks.validate import validate_file
from composer.errors import SpecError

REPO = Path(__file__).resolve().parent.parent
HEAD = "name: t\nsources:\n  verifier: {kind: outcome_reward}\n"
GRPO = HEAD + "signal: {kind: reward, source: verifier}\nobjective: {kind: grpo}\ntrain: {steps: 10}\n"
LOCATED = re.compile(r"^(?P<file>.+?):(?P<line>\d+):(?P<col>\d+): (?P<sev>error|warning): (?P<path>[^:]+): (?P<msg>.*)$")


def _validate(cli, tmp_path, text, *overrides):
    spec = tmp_path / "spec.yaml"
    spec.write_text(text)
    return spec, cli("validate", spec, *overrides)


def _refused(cli, tmp_path, text, overrides, path, fragment, rule, severity="error"):
    spec, r = _validate(cli, tmp_path, text, *overrides)
    assert r.exit_code == (2 if severity == "error" else 0), r.stderr
    assert "Traceback" not in r.stderr and "internal error" not in r.stderr
    lines = r.stderr.splitlines()
    hits = [i for i, line in enumerate(lines) if (m := LOCATED.match(line)) and m["path"] == path and m["sev"] == severity]
    assert hits, f"no {severity} at {path}:\n{r.stderr}"
    assert fragment in lines[hits[0]], r.stderr
    assert lines[hits[0] + 1].strip().startswith("hint: "), r.stderr  # every refusal says how to fix it
    if severity == "error":
        with pytest.raises(SpecError) as e:
            validate_file(spec, list(overrides))
        assert rule in {d.rule for d in e.value.diagnostics}
    else:
        assert rule in {d.rule for d in validate_file(spec, list(overrides)).warnings}
    return r


def _ok(cli, tmp_path, text, *overrides):
    _spec, r = _validate(cli, tmp_path, text, *overrides)
    assert r.exit_code == 0, r.stderr
    assert "warning" not in r.stderr, r.stderr


# ---------------------------------------------------------------------------------------------- sync

def test_reuse_with_a_sync_every_step(cli, tmp_path):
    _refused(cli, tmp_path, GRPO + "sync: {reuse: true}\n", [], "sync.reuse", "exactly as without reuse",
             "sync_settings")
    _ok(cli, tmp_path, HEAD + "signal: {kind: reward, source: verifier}\nobjective: {kind: advantage_regression}\n"
        "sync: {every: 4, reuse: true}\n")


def test_off_policy_ok_with_a_sync_every_step(cli, tmp_path):
    r = _refused(cli, tmp_path, GRPO + "sync: {off_policy_ok: true}\n", [], "sync.off_policy_ok",
                 "no lag to allow", "sync_settings")
    assert "spec.yaml:" in r.stderr  # located in the file, not only by path
    _ok(cli, tmp_path, GRPO + "sync: {every: 4, off_policy_ok: true}\n")


def test_off_policy_ok_that_acts_in_one_phase_is_kept(cli, tmp_path):
    """Written once at the top, it governs both phases: inert in the first, needed in the lagged second."""
    _ok(cli, tmp_path, GRPO.replace("train: {steps: 10}\n", "") + "sync: {off_policy_ok: true}\ntrain: {steps: 10}\n"
        "phases:\n  - {until: 5}\n  - {until: 10, sync: {every: 4}}\n")


# ---------------------------------------------------------------------------------------- objectives

def test_kl_estimator_with_kl_coef_zero(cli, tmp_path):
    text = GRPO.replace("{kind: grpo}", "{kind: grpo, kl_coef: 0, kl_estimator: k1}")
    _refused(cli, tmp_path, text, [], "objective.kl_estimator", "no KL loss", "objective_settings")
    _ok(cli, tmp_path, GRPO.replace("{kind: grpo}", "{kind: grpo, kl_coef: 0.01, kl_estimator: k1}"))


def test_kl_estimator_used_by_a_later_phase_is_kept(cli, tmp_path):
    text = GRPO.replace("{kind: grpo}", "{kind: grpo, kl_coef: 0, kl_estimator: k2}").replace(
        "train: {steps: 10}\n", "train: {steps: 10}\nphases:\n  - {until: 5}\n  - {until: 10, objective: {kl_coef: 0.01}}\n")
    _ok(cli, tmp_path, text)


def test_clip_low_above_one(cli, tmp_path):
    text = GRPO.replace("{kind: grpo}", "{kind: grpo, clip_low: 1.5}").replace("{steps: 10}", "{steps: 10, mini_batches: 2}")
    _refused(cli, tmp_path, text, [], "objective.clip_low", "1 - 1.5 = -0.5", "objective_settings")
    _ok(cli, tmp_path, text.replace("clip_low: 1.5", "clip_low: 1.0"))  # CISPO's: no lower bound, allowed


def test_symmetric_clip_above_one(cli, tmp_path):
    text = GRPO.replace("{kind: grpo}", "{kind: grpo, clip: 2}").replace("{steps: 10}", "{steps: 10, mini_batches: 2}")
    _refused(cli, tmp_path, text, [], "objective.clip", "never negative", "objective_settings")


def test_clip_hidden_by_clip_low_and_clip_high(cli, tmp_path):
    text = GRPO.replace("{kind: grpo}", "{kind: grpo, clip: 0.3, clip_low: 0.2, clip_high: 0.28}").replace(
        "{steps: 10}", "{steps: 10, mini_batches: 2}")
    _refused(cli, tmp_path, text, [], "objective.clip", "clip is never used", "objective_settings")


def test_explicit_clip_with_one_on_policy_update_is_a_warning(cli, tmp_path):
    """Decision: a warning, not a refusal. The bound is harmless where it cannot act (and guards against the
    sampler's numerical drift), so a spec ported from a framework that always sets it still runs; but it is said."""
    text = GRPO.replace("{kind: grpo}", "{kind: grpo, clip_high: 0.28}")
    _refused(cli, tmp_path, text, [], "objective.clip_high", "cannot act", "objective_settings", severity="warning")
    _ok(cli, tmp_path, text.replace("{steps: 10}", "{steps: 10, mini_batches: 2}"))  # several updates: it acts
    _ok(cli, tmp_path, text + "sync: {every: 2, off_policy_ok: true}\n")  # a lagged sampler: it acts
    _ok(cli, tmp_path, GRPO)  # the default clip of plain GRPO: nothing said at validate


def test_explain_says_the_default_clip_is_inert(cli):
    r = cli("explain", REPO / "specs/grpo.yaml")
    assert r.exit_code == 0, r.stderr
    assert "inert here: clip" in r.stdout and "cannot act" in r.stdout
    r = cli("explain", REPO / "specs/methods/dapo.yaml")  # two mini-batches per step: the clip acts
    assert r.exit_code == 0 and "PPO clip [1-0.2, 1+0.28]" in r.stdout and "inert here" not in r.stdout


def test_off_policy_weight_without_a_token_the_policy_did_not_write(cli, tmp_path):
    text = GRPO.replace("{kind: grpo}", "{kind: grpo, off_policy_weight: {kind: shaped}}")
    _refused(cli, tmp_path, text, [], "objective.off_policy_weight", "holds none", "objective_settings")
    _ok(cli, tmp_path, text.replace("  verifier: {kind: outcome_reward}\n", "  verifier: {kind: outcome_reward}\n"
                                    "  ref: {kind: reference_solution}\n").replace(
        "signal:", "rollout: {guide: {kind: traces, source: ref}}\nsignal:").replace(
        "{kind: shaped}", "{kind: shaped}, loss_tokens: [policy, demonstration]"))


def test_divergence_field_of_another_estimator(cli, tmp_path):
    text = HEAD + "  teacher: {kind: policy_model, model: big}\nsignal: {kind: distillation, teacher: teacher}\n" \
        "objective: {kind: divergence, estimator: full, k: 50}\n"
    _refused(cli, tmp_path, text, [], "objective.k", "never read", "objective_settings")
    _refused(cli, tmp_path, text.replace("estimator: full, k: 50", "beta: 0.3"), [], "objective.beta",
             "JSD mixture weight", "objective_settings")


# --------------------------------------------------------------------------------------------- gates

GATED = HEAD + "rollout: {samples_per_prompt: 4}\nterms:\n  - {signal: {kind: reward, source: verifier}, " \
    "objective: {kind: grpo}, gate: GATE}\ntrain: {steps: 10}\n"


@pytest.mark.parametrize("gate,path,fragment", [
    ("{outcome: success, group_success_at_most: 0}", "terms[0].gate.group_success_at_most", "outcome: success"),
    ("{outcome: failure, group_success_above: 0.75}", "terms[0].gate.group_success_above", "groups of 4"),
    ("{group_success_above: 1}", "terms[0].gate.group_success_above", "can never select a row"),
    ("{sibling_success: true, group_success_at_most: 0}", "terms[0].gate.sibling_success", "sibling_success: true"),
    ("{outcome: failure, sibling_success: false, group_success_above: 0}", "terms[0].gate.sibling_success",
     "group_success_above: 0, sibling_success: false"),
])
def test_gate_that_no_row_can_pass(cli, tmp_path, gate, path, fragment):
    _refused(cli, tmp_path, GATED.replace("GATE", gate), [], path, fragment, "gate_selects")


@pytest.mark.parametrize("gate", ["{outcome: success, group_success_above: 0.5}", "{outcome: failure, sibling_success: true}",
                                  "{outcome: success, group_success_at_most: 0.25}", "{group_success_at_most: 0}"])
def test_gates_some_row_can_pass_validate(cli, tmp_path, gate):
    _ok(cli, tmp_path, GATED.replace("GATE", gate))


def test_a_success_with_a_successful_sibling_needs_two_rollouts(cli, tmp_path):
    gate = GATED.replace("GATE", "{outcome: success, sibling_success: true}")
    _ok(cli, tmp_path, gate.replace("samples_per_prompt: 4", "samples_per_prompt: 2"))  # the other may succeed
    _spec, r = _validate(cli, tmp_path, gate.replace("samples_per_prompt: 4", "samples_per_prompt: 1"))
    assert r.exit_code == 2 and "a group of one has no sibling" in r.stderr, r.stderr


# ------------------------------------------------------------------------------------------- rewards

def test_reward_part_of_infinite_weight(cli, tmp_path):
    """Refused by the schema now (no float field takes .inf unless it documents it: tests/test_spec_numbers.py)."""
    text = HEAD + "  overlong: {kind: overlong_penalty, buffer: 4}\n" \
        "signal: {kind: reward, source: verifier, plus: {overlong: .inf}}\nobjective: {kind: grpo}\n"
    _spec, r = _validate(cli, tmp_path, text)
    assert r.exit_code == 2 and "signal.plus.overlong: inf is not a finite number" in r.stderr, r.stderr
    _ok(cli, tmp_path, text.replace(".inf", "1.0"))


def test_reward_part_repeating_the_signals_source(cli, tmp_path):
    text = HEAD + "signal: {kind: reward, source: verifier, plus: {verifier: 1}}\nobjective: {kind: grpo}\n"
    _refused(cli, tmp_path, text, [], "signal.plus.verifier", "counted twice", "reward_parts")


def test_reward_part_that_is_the_same_reward_under_another_name(cli, tmp_path):
    text = HEAD + "  again: {kind: outcome_reward}\n" \
        "signal: {kind: reward, source: verifier, plus: {again: 0.5}}\nobjective: {kind: grpo}\n"
    _refused(cli, tmp_path, text, [], "signal.plus.again", "the same reward as 'verifier'", "reward_parts")
    _ok(cli, tmp_path, text.replace("again: {kind: outcome_reward}", "again: {kind: outcome_reward, verifier: exact}"))


# ------------------------------------------------------------------------------------------- filters

def test_truncated_drop_with_one_new_token(cli, tmp_path):
    _refused(cli, tmp_path, GRPO, ["rollout.max_new_tokens=1", "rollout.filter.truncated=drop"],
             "rollout.filter.truncated", "keeps only empty answers", "filter_keeps")
    _ok(cli, tmp_path, GRPO, "rollout.max_new_tokens=64", "rollout.filter.truncated=drop")


def test_equal_groups_drop_with_one_sample(cli, tmp_path):
    text = HEAD + "rollout: {samples_per_prompt: 1, filter: {equal_groups: drop}}\n" \
        "signal: {kind: reward, source: verifier}\nobjective: {kind: advantage_regression, beta1: .inf}\n"
    _refused(cli, tmp_path, text, [], "rollout.filter.equal_groups", "every prompt is dropped", "filter_keeps")


# ----------------------------------------------------------------------------------------- schedules

def test_schedule_beginning_after_the_run(cli, tmp_path):
    text = GRPO.replace("{steps: 10}", "{steps: 10, entropy_coef: {kind: linear, start: 0.01, end: 0, steps: 5, "
                        "begin: 20}}")
    _refused(cli, tmp_path, text, [], "train.entropy_coef", "lies at or after the last step (9)", "schedule_acts")
    _ok(cli, tmp_path, text.replace("begin: 20", "begin: 2"))


def test_schedule_in_a_quick_override_run_is_a_warning(cli, tmp_path):
    """train.steps from the command line (a short trial of a longer spec): said, not refused, as phases_run."""
    _refused(cli, tmp_path, (REPO / "specs/methods/kdrl.yaml").read_text(), ["train.steps=1"], "terms[1].weight",
             "cannot change", "schedule_acts", severity="warning")


def test_scheduled_weight_zero_over_the_whole_run(cli, tmp_path):
    text = HEAD + "terms:\n  - {signal: {kind: reward, source: verifier}, objective: {kind: grpo}}\n" \
        "  - {signal: {kind: reward, source: verifier}, objective: {kind: grpo}, " \
        "weight: {kind: linear, start: 0, end: 1, steps: 10, begin: 50}}\ntrain: {steps: 20}\n"
    _refused(cli, tmp_path, text, [], "terms[1].weight", "the term never trains", "schedule_acts")


def test_schedule_that_stays_in_one_stage_and_moves_in_another(cli, tmp_path):
    """A stage counts global steps: a weight that ramps in the second stage is not inert because the first
    stage sees only its start."""
    text = HEAD + "terms:\n  - {name: a, signal: {kind: reward, source: verifier}, objective: {kind: grpo}}\n" \
        "  - {name: b, signal: {kind: reward, source: verifier}, objective: {kind: grpo}, " \
        "weight: {kind: linear, start: 0.5, end: 1, steps: 10, begin: 12}}\n" \
        "stages:\n  - {name: one, train: {steps: 10}}\n  - {name: two, train: {steps: 10}}\n"
    _ok(cli, tmp_path, text)


def test_phase_that_never_starts(cli, tmp_path):
    spec, r = _validate(cli, tmp_path, GRPO + "phases:\n  - {until: 10}\n  - {until: 20}\n")
    assert r.exit_code == 2 and "phases[1]: phase 1 starts at step 10" in r.stderr and "never runs" in r.stderr


# ---------------------------------------------- issue 57 item 6: settings that can never act, 13 cases
# (1-2) vLLM-only settings with engine: hf; (3) rollout settings on an SFT spec; (4-5) optimizer_at_stage and
# reference without stages; (6) reset_every beyond the run; (7) resetting a reference nothing reads; (8-9) toy-only
# settings with a data file; (10) data-file settings on the toy; (11) chat-template variables with plain prompts;
# (12) a phase override equal to the base; (13) a spec whose only term has weight 0.

SFT = "name: t\nsources:\n  reference: {kind: reference_solution}\nsignal: {kind: sft, target: reference}\n" \
    "objective: {kind: cross_entropy, loss_tokens: [demonstration]}\ntrain: {steps: 10}\n"
STAGED = HEAD + "signal: {kind: reward, source: verifier}\nobjective: {kind: grpo}\n" \
    "stages:\n  - {name: one, train: {steps: 5}}\n  - {name: two, train: {steps: 5}}\n"


@pytest.mark.parametrize("field,value", [("gpu_memory_utilization", 0.9), ("tensor_parallel_size", 2)])
def test_vllm_setting_with_the_hf_engine(cli, tmp_path, field, value):
    _refused(cli, tmp_path, GRPO, ["rollout.engine=hf", f"rollout.{field}={value}"], f"rollout.{field}",
             "rollout.engine: hf samples with transformers' generate", "rollout_settings")
    _ok(cli, tmp_path, GRPO, "rollout.engine=vllm", f"rollout.{field}={value}")
    _ok(cli, tmp_path, GRPO, f"rollout.{field}={value}")  # auto: vLLM where it is installed


@pytest.mark.parametrize("item", ["rollout.temperature=0.7", "rollout.samples_per_prompt=4", "rollout.top_k=20",
                                  "rollout.engine=hf", "rollout.filter.equal_groups=drop"])
def test_rollout_setting_on_a_spec_that_samples_no_rollouts(cli, tmp_path, item):
    path = item.split("=")[0]
    _refused(cli, tmp_path, SFT, [item], path, "this spec samples no rollouts", "rollout_settings")


def test_rollout_settings_that_act_without_rollouts(cli, tmp_path):
    """Evaluation generates with max_new_tokens, and samples at the rollout's temperature for pass@k."""
    _ok(cli, tmp_path, SFT, "rollout.max_new_tokens=64")
    _ok(cli, tmp_path, SFT, "rollout.temperature=0.7", "train.eval_k=4")
    _ok(cli, tmp_path, GRPO, "rollout.temperature=0.7")
    text = STAGED.replace("  - {name: one, train: {steps: 5}}", "  - {name: one, train: {steps: 5}, signal: {kind: "
                          "sft, target: ref}, objective: {kind: cross_entropy, loss_tokens: [demonstration]}}") \
        .replace("  verifier: {kind: outcome_reward}\n", "  verifier: {kind: outcome_reward}\n  ref: {kind: reference_solution}\n")
    _ok(cli, tmp_path, text, "rollout.temperature=0.7")  # the second stage samples at it


@pytest.mark.parametrize("item", ["train.optimizer_at_stage=keep", "train.reference=run_start"])
def test_stage_setting_without_stages(cli, tmp_path, item):
    path = item.split("=")[0]
    _refused(cli, tmp_path, GRPO, [item], path, "this spec has no stages", "train_settings")
    _refused(cli, tmp_path, STAGED, [f"stages.0.{item}"], f"stages[0].{path}", "the first stage is the start of the run",
             "train_settings")
    _ok(cli, tmp_path, STAGED, f"stages.1.{item}")
    _ok(cli, tmp_path, STAGED, item)  # written once: it acts at the second stage


def test_reference_of_stages_that_nothing_reads(cli, tmp_path):
    _refused(cli, tmp_path, STAGED, ["train.reference=run_start", "objective.kl_coef=0"], "train.reference",
             "nothing here reads them", "train_settings")


def test_reset_every_beyond_the_run(cli, tmp_path):
    text = GRPO.replace("{steps: 10}", "{steps: 10, reset_every: 20}")
    _refused(cli, tmp_path, text, [], "train.reset_every", "no reset happens", "train_settings")
    _ok(cli, tmp_path, text.replace("reset_every: 20", "reset_every: 5"))


def test_resetting_a_reference_nothing_reads(cli, tmp_path):
    text = GRPO.replace("{kind: grpo}", "{kind: grpo, kl_coef: 0}").replace(
        "{steps: 10}", "{steps: 10, reset_every: 5, reset_what: [reference]}")
    _refused(cli, tmp_path, text, [], "train.reset_what", "nothing here reads it", "train_settings")
    _ok(cli, tmp_path, text.replace("kl_coef: 0", "kl_coef: 0.01"))  # the KL term reads the reference
    _ok(cli, tmp_path, text.replace("reset_what: [reference]", "reset_what: [optimizer]"))
    _refused(cli, tmp_path, GRPO, ["train.reset_what=[optimizer]"], "train.reset_what", "no periodic reset",
             "train_settings")


@pytest.fixture
def rows(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text('{"prompt": "1+1?", "answer": "2"}\n{"prompt": "2+2?", "answer": "4"}\n')
    return [f"data.train={path}", "rollout.max_new_tokens=64"]


@pytest.mark.parametrize("field", ["tiers", "train_tiers"])
def test_toy_setting_with_a_data_file(cli, tmp_path, rows, field):
    _refused(cli, tmp_path, GRPO, [*rows, f"data.{field}=[2]"], f"data.{field}", "data.train names a data file",
             "data_settings")
    _ok(cli, tmp_path, GRPO, f"data.{field}=[2]")


@pytest.mark.parametrize("item", ["data.prompt_field=problem", "data.answer_field=gold", "data.on_bad_row=skip",
                                  "data.prompt_format=plain"])
def test_data_file_setting_on_the_toy(cli, tmp_path, rows, item):
    _refused(cli, tmp_path, GRPO, [item], item.split("=")[0], "there is no data.train", "data_settings")
    _ok(cli, tmp_path, GRPO, *rows, item.replace("problem", "prompt").replace("gold", "answer"))


def test_chat_template_variables_with_plain_prompts(cli, tmp_path, rows):
    kwargs = "data.chat_template_kwargs={enable_thinking: false}"
    _refused(cli, tmp_path, GRPO, [*rows, "data.prompt_format=plain", kwargs], "data.chat_template_kwargs",
             "prompt_format: plain renders no template", "data_settings")
    _ok(cli, tmp_path, GRPO, *rows, kwargs)  # auto: the template where the tokenizer has one


def test_phase_override_equal_to_the_base(cli, tmp_path):
    text = GRPO.replace("{kind: grpo}", "{kind: grpo, kl_coef: 0.01}") + \
        "phases:\n  - {until: 5}\n  - {until: 10, objective: {kl_coef: 0.01}}\n"
    _refused(cli, tmp_path, text, [], "phases[1].objective.kl_coef", "the override changes nothing", "phase_changes")
    _refused(cli, tmp_path, GRPO + "phases:\n  - {until: 5}\n  - {until: 10, rollout: {guide: {kind: none}}}\n", [],
             "phases[1].rollout.guide.kind", "none, the base spec's value too", "phase_changes")
    _ok(cli, tmp_path, text.replace("objective: {kl_coef: 0.01}", "objective: {kl_coef: 0.02}"))


def test_the_only_term_of_weight_zero(cli, tmp_path):
    """Was a warning: with every term at weight 0 nothing trains. One term of several at 0 stays a warning."""
    term = "  - {signal: {kind: reward, source: verifier}, objective: {kind: grpo}, weight: W}\n"
    text = HEAD + "terms:\n" + term.replace("W", "0")
    _refused(cli, tmp_path, text, [], "terms[0].weight", "the only term: nothing trains", "term_weight_positive")
    _ok(cli, tmp_path, HEAD + "terms:\n" + term.replace("W", "1"))
    _refused(cli, tmp_path, text + term.replace("W", "1"), [], "terms[0].weight", "its loss is ignored",
             "term_weight_positive", severity="warning")


# ------------------------------------------------------------------------------------------ overrides

@pytest.mark.parametrize("item,path", [("data.train=", "data.train"), ("policy.model=", "policy.model"),
                                       ("policy.model=  ", "policy.model")])
def test_empty_override(cli, tmp_path, item, path):
    spec, r = _validate(cli, tmp_path, GRPO, item)
    assert r.exit_code == 2, r.stderr
    assert re.search(rf"<override '{re.escape(item)}'>:1:1: error: {re.escape(path)}: the override", r.stderr), r.stderr
    assert "deleting it" in r.stderr and "Traceback" not in r.stderr


# -------------------------------------------------------------------------------------------- at large

def test_validation_of_an_inert_setting_never_imports_torch(tmp_path):
    spec = tmp_path / "spec.yaml"
    spec.write_text(GATED.replace("GATE", "{outcome: success, group_success_at_most: 0}"))
    code = ("import sys\nfrom composer.cli.main import main\ntry:\n    main(['validate', sys.argv[1]])\n"
            "except SystemExit as e:\n    assert 'torch' not in sys.modules, 'torch imported'\n    sys.exit(e.code)\n")
    r = subprocess.run([sys.executable, "-c", code, str(spec)], capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 2, r.stderr
    assert "can never select a row" in r.stderr and "Traceback" not in r.stderr
