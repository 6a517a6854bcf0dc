"""Layer 4: method semantics. Each rule is a small registered function over one resolved spec.

A rule returns diagnostics for combinations that are well-formed but wrong, each with a reason and
a fix. Rules see a resolved segment (the base spec with one phase or stage merged in), so a phase
that switches the guide off is checked as what it is.
"""

from __future__ import annotations

from typing import Callable

from composer.errors import Diagnostic
from composer.checks.graph import signal_objective_pairs

RULES: dict[str, Callable] = {}
OFF_POLICY_ORIGINS = ("guide_prefix", "guide_intervention", "demonstration")


def rule(name: str):
    def deco(fn):
        RULES[name] = fn
        return fn

    return deco


def _pairs_with_paths(spec):
    for i, (sig, obj) in enumerate(signal_objective_pairs(spec)):
        base = ("terms", i) if spec.terms else ()
        yield base, sig, obj


def _d(name, message, path, hint, severity="error"):
    return Diagnostic("semantics", message, tuple(path), None, hint, severity, name)


@rule("signal_and_objective")
def signal_and_objective(spec, segment):
    if segment == "base" and spec.stages:
        return []  # stages may each bring their own signal and objective; every stage is checked itself
    if spec.terms and (spec.signal or spec.objective):
        return [_d("signal_and_objective", "both `terms` and `signal`/`objective` are given", ("terms",),
                   "write either one signal + objective, or a list of terms")]
    if not spec.terms and (spec.signal is None or spec.objective is None):
        missing = "signal" if spec.signal is None else "objective"
        return [_d("signal_and_objective", f"no `{missing}`: a method needs a signal and an objective", (missing,),
                   "add `signal:` and `objective:` (or `terms:`)")]
    return []


@rule("objective_reads_its_signal")
def objective_reads_its_signal(spec, segment):
    """An objective needs what its signal provides (divergence needs a distillation signal, ...)."""
    out = []
    for base, sig, obj in _pairs_with_paths(spec):
        if sig is None or obj is None:
            continue
        missing = [n for n in obj.needs if n not in sig.provides]
        if missing:
            wanted = {"teacher_logprobs": "distillation", "reward": "reward", "sft_target": "sft"}
            kinds = " or ".join(wanted.get(n, n) for n in missing)
            out.append(_d("objective_reads_its_signal",
                          f"a {obj.kind_name()} objective needs {', '.join(missing)}, which a {sig.kind_name()} "
                          f"signal does not provide", base + ("objective", "kind"),
                          f"use a {kinds} signal, or an objective that reads {sig.kind_name()}"))
    return out


@rule("policy_gradient_on_guide_tokens")
def policy_gradient_on_guide_tokens(spec, segment):
    out = []
    for base, sig, obj in _pairs_with_paths(spec):
        if obj is None or not type(obj).policy_gradient:
            continue
        fine = obj.capabilities().exact_origins | obj.weighted_origins()
        bad = [o for o in obj.loss_tokens if o in OFF_POLICY_ORIGINS and o not in fine]
        if bad and "estimator" in type(obj).model_fields:  # an estimator choice: say which one is exact
            exact = [e for e in ("full", "top_k")
                     if bad[0] in obj.model_copy(update={"estimator": e}).capabilities().exact_origins]
            if exact:
                out.append(_d("policy_gradient_on_guide_tokens",
                              f"{obj.kind_name()} with estimator '{obj.estimator}' is a single-sample estimate from "
                              f"tokens the policy sampled (an importance-weighted policy gradient), but loss_tokens "
                              f"includes {', '.join(bad)}, which the policy did not write", base + ("objective", "estimator"),
                              f"use estimator: {' or '.join(exact)} (exact over the vocabulary at each position, no sample needed)"))
                continue
        if bad:
            weigh = ("give them an importance-weight form of the policy's probability (off_policy_weight: {kind: "
                     "shaped, gamma: 0.1} is LUFFY's policy shaping; `composer list off_policy_weight`), "
                     if "off_policy_weight" in type(obj).model_fields else "")
            out.append(_d("policy_gradient_on_guide_tokens",
                          f"{obj.kind_name()} is a policy gradient, but loss_tokens includes {', '.join(bad)}: "
                          "those tokens were not sampled by the policy, so their importance ratios are wrong",
                          base + ("objective", "loss_tokens"),
                          f"{weigh}mask them (loss_tokens: [policy]), or use advantage_regression, which anchors "
                          "them"))
    return out


@rule("lag_needs_correction")
def lag_needs_correction(spec, segment):
    if spec.sync.every <= 1 or spec.sync.off_policy_ok:
        return []
    out = []
    for base, sig, obj in _pairs_with_paths(spec):
        if obj is not None and obj.capabilities().on_policy_only:
            out.append(_d("lag_needs_correction",
                          f"sync.every is {spec.sync.every}, but {obj.kind_name()} assumes on-policy data: its "
                          "ratio correction only holds near the sampling weights", ("sync", "every"),
                          "use advantage_regression (OAPL), set sync.every: 1, or set sync.off_policy_ok: true "
                          "to study the lag on purpose"))
    return out


@rule("control_baseline_needs_controls")
def control_baseline_needs_controls(spec, segment):
    guide = spec.rollout.guide
    out = []
    for base, sig, obj in _pairs_with_paths(spec):
        if getattr(obj, "baseline", None) != "control":
            continue
        if guide.kind_name() == "intervention" and guide.control_samples == 0:
            out.append(_d("control_baseline_needs_controls",
                          "baseline: control, but the intervention guide has control_samples: 0, so no rollout "
                          "is a control", base + ("objective", "baseline"),
                          "set rollout.guide.control_samples (MInTRL: 8 of 16) or baseline: all"))
        if guide.kind_name() == "prefix" and guide.guided_fraction >= 1:
            out.append(_d("control_baseline_needs_controls",
                          "baseline: control, but every prompt is guided (guided_fraction: 1)",
                          base + ("objective", "baseline"), "lower rollout.guide.guided_fraction or use baseline: all"))
    return out


@rule("control_samples_fit")
def control_samples_fit(spec, segment):
    guide = spec.rollout.guide
    n = getattr(guide, "control_samples", 0)
    if n and n >= spec.rollout.samples_per_prompt:
        return [_d("control_samples_fit",
                   f"control_samples ({n}) must be less than samples_per_prompt ({spec.rollout.samples_per_prompt}),"
                   " or no rollout can be guided", ("rollout", "guide", "control_samples"),
                   f"for example control_samples: {spec.rollout.samples_per_prompt // 2}")]
    return []


@rule("traces_fit")
def traces_fit(spec, segment):
    """The traces guide replaces k of each group's rows: at least one row stays the policy's rollout."""
    guide = spec.rollout.guide
    k, n = getattr(guide, "per_group", 0), spec.rollout.samples_per_prompt
    if guide.kind_name() == "traces" and k >= n:
        return [_d("traces_fit", f"per_group ({k}) traces fill every one of the {n} rows of a group: no row is the "
                   "policy's own rollout, so nothing on-policy trains and a group's rewards compare traces only",
                   ("rollout", "guide", "per_group"), f"use per_group below samples_per_prompt (LUFFY: 1 of 8; here "
                   f"at most {n - 1}), or SFT (signal: {{kind: sft}}) to train on the traces alone")]
    return []


@rule("trace_rows_trained")
def trace_rows_trained(spec, segment):
    """The traces guide's rows are demonstration tokens: a term on the rollout that leaves them out of its
    loss_tokens trains on the policy's rows only (the traces then only move the group's baseline)."""
    if spec.rollout.guide.kind_name() != "traces":
        return []
    out = []
    guide = spec.rollout.guide
    for base, sig, obj in _pairs_with_paths(spec):
        if sig is None or obj is None or sig.makes_batch or "demonstration" not in sig.origins(guide):
            continue
        if "demonstration" not in obj.loss_tokens:
            out.append(_d("trace_rows_trained", f"the traces guide puts traces the policy did not write into each "
                          "group as demonstration tokens, and this objective's loss_tokens "
                          f"({', '.join(obj.loss_tokens)}) leave them out: they would move the group's baseline "
                          "and never train", base + ("objective", "loss_tokens"),
                          f"add demonstration: loss_tokens: [{', '.join([*obj.loss_tokens, 'demonstration'])}]"
                          + (" with off_policy_weight (LUFFY: {kind: shaped, gamma: 0.1})"
                             if "off_policy_weight" in type(obj).model_fields else "")))
    return out


@rule("group_baseline_needs_groups")
def group_baseline_needs_groups(spec, segment):
    if spec.rollout.samples_per_prompt > 1:
        return []
    out = []
    for base, sig, obj in _pairs_with_paths(spec):
        if obj is not None and obj.group_baseline() and getattr(sig, "kind", "") == "reward":
            out.append(_d("group_baseline_needs_groups",
                          f"{obj.kind_name()} uses a group baseline, but samples_per_prompt is 1: every advantage "
                          "is zero", ("rollout", "samples_per_prompt"), "sample several responses per prompt (GRPO: 8-64)"))
        elif obj is not None and type(obj).couples_rows == "group" and getattr(sig, "kind", "") == "reward":
            out.append(_d("group_baseline_needs_groups",
                          f"{obj.kind_name()} trains on pairs of rollouts of one prompt, but samples_per_prompt is 1: "
                          "no group holds two rows, so no pair ever forms", ("rollout", "samples_per_prompt"),
                          "sample several responses per prompt (e.g. 8)"))
    return out


@rule("guided_sft_needs_guide")
def guided_sft_needs_guide(spec, segment):
    out = []
    for base, sig, obj in _pairs_with_paths(spec):
        if getattr(sig, "kind", "") == "sft" and sig.target == "guided" and spec.rollout.guide.kind_name() == "none":
            out.append(_d("guided_sft_needs_guide", "sft with target: guided needs a guide that writes into rollouts",
                          base + ("signal", "target"), "set rollout.guide (InT: kind: intervention, review: end)"))
    return out


@rule("teacher_shares_tokenizer")
def teacher_shares_tokenizer(spec, segment):
    out = []
    for base, sig, obj in _pairs_with_paths(spec):
        if getattr(sig, "kind", "") != "distillation":
            continue
        teacher = spec.sources.get(sig.teacher)
        # rules must not assume graph-validity: a rule never crashes on a teacher of another kind
        if teacher is not None and teacher.kind_name() == "policy_model" and not teacher.is_self \
                and not teacher.shares_tokenizer:
            out.append(_d("teacher_shares_tokenizer",
                          f"distillation from '{sig.teacher}' needs log-probs on the student's tokens, but the teacher "
                          "is declared with shares_tokenizer: false", ("sources", sig.teacher, "shares_tokenizer"),
                          "distil from a teacher with the policy's tokenizer"))
    return out


@rule("self_weights_only_for_self")
def self_weights_only_for_self(spec, segment):
    out = []
    for name, src in spec.sources.items():
        if src.kind_name() == "policy_model" and not src.is_self and src.weights != "current":
            out.append(_d("self_weights_only_for_self",
                          f"weights: {src.weights} applies to `model: self`; '{src.model}' is a separate, frozen model",
                          ("sources", name, "weights"), "remove `weights` or use model: self"))
    return out


@rule("phases_cover_steps")
def phases_cover_steps(spec, segment):
    """Checked on the base spec: phases increase and the last covers train.steps."""
    if segment != "base" or not spec.phases:
        return []
    out = []
    prev = 0
    for i, ph in enumerate(spec.phases):
        if ph.until <= prev:
            out.append(_d("phases_cover_steps", f"phase {i} ends at step {ph.until}, not after the previous phase "
                          f"({prev})", ("phases", i, "until"), "list phases in increasing `until`"))
        prev = ph.until
    if prev < spec.train.steps and not out:
        out.append(_d("phases_cover_steps", f"the last phase ends at step {prev} but train.steps is {spec.train.steps}",
                      ("phases", len(spec.phases) - 1, "until"),
                      f"add `- {{until: {spec.train.steps}}}` to say what happens after step {prev}"))
    if spec.stages:
        out.append(_d("phases_cover_steps", "phases and stages together are ambiguous", ("phases",),
                      "put the phases inside the stage they belong to"))
    return out


@rule("stages_well_formed")
def stages_well_formed(spec, segment):
    if segment != "base" or not spec.stages:
        return []
    out, seen = [], set()
    for i, st in enumerate(spec.stages):
        if st.name in seen:
            out.append(_d("stages_well_formed", f"two stages are named '{st.name}'", ("stages", i, "name"),
                          "give each stage its own name"))
        seen.add(st.name)
    return out


@rule("sampled_divergence_is_reverse_kl")
def sampled_divergence_is_reverse_kl(spec, segment):
    out = []
    for base, sig, obj in _pairs_with_paths(spec):
        if obj is not None and obj.kind_name() == "divergence" and obj.estimator == "sampled" \
                and obj.measure != "reverse_kl":
            out.append(_d("sampled_divergence_is_reverse_kl",
                          f"estimator: sampled estimates reverse KL only (a single sample of the student's own "
                          f"token); measure is {obj.measure}", base + ("objective", "estimator"),
                          "use estimator: full or top_k for forward_kl and jsd"))
    return out


def _judge_names(spec) -> set[str]:
    return {n for names in spec.rollout.guide.ref_names().values() for n in names}


@rule("template_fields")
def template_fields(spec, segment):
    """A policy_model `template` names only fields the composer fills, and places every declared context."""
    import difflib

    out = []
    judges = _judge_names(spec)
    for name, src in spec.sources.items():
        if src.kind_name() != "policy_model" or src.template is None:
            continue
        allowed = ["problem", "prompt", *src.context] + (["accepted", "steps"] if name in judges else [])
        fields = src.template_fields()
        for f in sorted(fields - set(allowed)):
            close = difflib.get_close_matches(f, allowed, 1)
            out.append(_d("template_fields", f"template field {{{f}}} is not filled for source '{name}' (it fills "
                          f"{', '.join('{' + a + '}' for a in allowed)})", ("sources", name, "template"),
                          (f"did you mean {{{close[0]}}}? " if close else "")
                          + "a context source's text is {its name}, after adding it to `context`"))
        for c in src.context:
            if c not in fields:
                out.append(_d("template_fields", f"source '{name}' declares context '{c}' but its template has no "
                              f"{{{c}}}: the context would never reach the prompt", ("sources", name, "template"),
                              f"place {{{c}}} in the template, or remove '{c}' from `context`"))
    return out


@rule("self_teacher_sees_something_else")
def self_teacher_sees_something_else(spec, segment):
    """A self-teacher on the live weights without context is the student itself: zero signal."""
    out = []
    for base, sig, _obj in _pairs_with_paths(spec):
        name = getattr(sig, "teacher", None) if sig is not None and type(sig).usage == "teacher" else None
        src = spec.sources.get(name) if name else None
        if src is not None and src.kind_name() == "policy_model" and src.is_self and src.weights == "current" \
                and not src.context:
            out.append(_d("self_teacher_sees_something_else", f"teacher '{name}' is the policy itself (model: self, "
                          "weights: current) with no context: it scores every token exactly as the student does, so "
                          "the signal is zero", ("sources", name),
                          "give it privileged context (context: [reference]) or other weights (weights: initial or ema)"))
    return out


@rule("loss_tokens_written")
def loss_tokens_written(spec, segment):
    """An objective's loss_tokens name origins the term's batch holds; one nothing writes does nothing."""
    if segment.startswith("phase"):
        return []  # a phase may switch the guide off while the objective keeps its loss_tokens
    out = []
    guide = spec.rollout.guide
    for base, sig, obj in _pairs_with_paths(spec):
        if sig is None or obj is None or not hasattr(obj, "loss_tokens"):
            continue
        missing = [o for o in obj.loss_tokens if o not in sig.origins(guide) and o != "prompt"]
        if missing:
            have = sorted(set(sig.origins(guide)) - {"prompt"})
            out.append(_d("loss_tokens_written", f"loss_tokens {missing} never occur in this term's batch (it holds "
                          f"{', '.join(have)})", base + ("objective", "loss_tokens"),
                          f"train on tokens that are there ({', '.join(have)}), or add the guide that writes "
                          f"{', '.join(missing)}"))
    return out


@rule("term_weight_positive")
def term_weight_positive(spec, segment):
    """A term whose weight is never positive has its loss ignored or maximised. Not warned: a negative weight on a
    distillation from the policy's own initial weights, which pushes away from the start on purpose (ExOPD's
    extrapolation, -(lambda - 1) KL(pi_theta || pi_ref))."""
    from composer.lang.curves import describe, values

    def away_from_initial(t) -> bool:
        name = getattr(t.signal, "teacher_source", None)
        src = spec.sources.get(name) if name else None
        return src is not None and getattr(src, "wants_initial", False) and max(values(t.weight)) < 0

    out = []
    whole = segment != "base" or not (spec.phases or spec.stages)  # the base of a phased spec never runs as it is
    zero = [values(t.weight) == (0, 0) and whole for t in spec.terms or []]
    for i, t in enumerate(spec.terms or []):
        lo, hi = values(t.weight)
        if all(zero):  # no term trains: every step computes a loss of 0 (issue 57: was a warning)
            out.append(_d("term_weight_positive", f"term {i} has weight {describe(t.weight)}, as "
                          + ("every term" if len(zero) > 1 else "the only term") + ": nothing trains (the loss is 0 "
                          "at every step)", ("terms", i, "weight"), "give the term a positive weight (e.g. 1.0)"))
        elif (hi <= 0 or lo < 0) and not away_from_initial(t):
            out.append(_d("term_weight_positive", f"term {i} has weight {describe(t.weight)}: its loss is "
                          + ("ignored" if hi == 0 and lo == 0 else "maximised, not minimised"), ("terms", i, "weight"),
                          "use a positive weight, or remove the term", severity="warning"))
    return out


@rule("several_updates_need_a_ratio")
def several_updates_need_a_ratio(spec, segment):
    """epochs x mini_batches > 1 trains on the same rollouts after the weights moved: an objective needs a
    correction for that (an importance ratio to the old log-probs) or to be off-policy by design."""
    t = spec.train
    if t.epochs * t.mini_batches <= 1 or spec.sync.off_policy_ok:
        return []
    out = []
    for base, sig, obj in _pairs_with_paths(spec):
        if obj is not None and type(obj).several_updates is None:
            field = "epochs" if t.epochs > 1 else "mini_batches"
            out.append(_d("several_updates_need_a_ratio",
                          f"train.{field} is {getattr(t, field)}, but {obj.kind_name()} has no importance ratio to "
                          "the old log-probs: every update after the first would treat rollouts of older weights "
                          "as the current policy's", ("train", field),
                          "set train.epochs: 1 and train.mini_batches: 1, use an objective with a ratio (grpo), or "
                          "set sync.off_policy_ok: true to train on the same rollouts several times on purpose"))
    return out


@rule("mini_batches_fit_groups")
def mini_batches_fit_groups(spec, segment):
    t = spec.train
    if t.mini_batches > t.prompts_per_step:
        return [_d("mini_batches_fit_groups", f"train.mini_batches is {t.mini_batches}, but a step has "
                   f"{t.prompts_per_step} prompts: mini-batches hold whole groups, so some would be empty",
                   ("train", "mini_batches"), f"use at most {t.prompts_per_step} mini-batches")]
    return []


@rule("sequence_ratio_clip")
def sequence_ratio_clip(spec, segment):
    """A sequence-level ratio (GSPO) is the exp of a mean of token log-ratios: it moves far less than a token
    ratio, and a token PPO clip range (0.2) would never act on it."""
    out = []
    for base, _sig, obj in _pairs_with_paths(spec):
        if obj is None or getattr(obj, "ratio", "token") == "token" or obj.bound != "clip":
            continue
        if not {"clip", "clip_low", "clip_high"} & obj.model_fields_set:
            out.append(_d("sequence_ratio_clip", f"ratio: {obj.ratio} with the clip range of token-level PPO "
                          f"(clip {obj.clip:g} by default): a length-normalised sequence ratio rarely leaves "
                          "[0.8, 1.2], so the clip would not act", base + ("objective", "clip_low"),
                          "set the sequence clip range explicitly, e.g. clip_low: 3.0e-4, clip_high: 4.0e-4 (GSPO)"))
    return out


@rule("bound_fields")
def bound_fields(spec, segment):
    """Fields that only mean something with another one: dual_clip with the PPO clip; an explicit estimator
    instead of the std_norm / std_eps shorthand."""
    out = []
    for base, _sig, obj in _pairs_with_paths(spec):
        if obj is None or obj.kind_name() != "grpo":
            continue
        if obj.dual_clip is not None and obj.bound != "clip":
            out.append(_d("bound_fields", f"dual_clip applies to the PPO clip, but bound is {obj.bound}",
                          base + ("objective", "dual_clip"), "remove dual_clip, or use bound: clip"))
        if obj.bound == "log_clip" and obj.ratio != "sequence":
            out.append(_d("bound_fields", f"bound: log_clip clips each token's log-ratio inside the geometric-mean "
                          f"sequence ratio (GMPO), but ratio is {obj.ratio}", base + ("objective", "ratio"),
                          "set ratio: sequence"))
        if obj.bound == "none" and obj.ratio != "token":
            out.append(_d("bound_fields", f"bound: none is a plain policy gradient with no importance ratio, so "
                          f"ratio: {obj.ratio} would not be used", base + ("objective", "ratio"),
                          "remove ratio, or choose a bound that reads it (clip, cispo, topr, ...)"))
        if obj.estimator is not None and {"std_norm", "std_eps"} & obj.model_fields_set:
            out.append(_d("bound_fields", "std_norm / std_eps describe the default estimator, but an estimator is "
                          "given", base + ("objective", "std_norm" if "std_norm" in obj.model_fields_set else
                                           "std_eps"),
                          "write it in the estimator: {kind: group_mean, std: group | batch | none, eps: ...}"))
    return out


@rule("several_updates_precision")
def several_updates_precision(spec, segment):
    t = spec.train
    if t.epochs * t.mini_batches > 1 and t.precision == "16-mixed":
        return [_d("several_updates_precision", "several updates per step step the optimizer inside the step, "
                   "which 16-mixed's loss scaler does not follow", ("train", "precision"),
                   "use bf16-mixed or 32-true")]
    return []


@rule("reward_parts_are_rewards")
def reward_parts_are_rewards(spec, segment):
    """Every source a reward signal adds (`plus`) gives a reward per rollout."""
    from composer import registry

    out = []
    for base, sig, _obj in _pairs_with_paths(spec):
        for name in getattr(sig, "plus", None) or {}:
            src = spec.sources.get(name)
            if src is not None and "sequence_reward" not in type(src).provides:
                kinds = sorted(k for k, c in registry.kinds("sources").items() if "sequence_reward" in c.provides)
                out.append(_d("reward_parts_are_rewards", f"'{name}' is a {src.kind_name()} source, which gives no "
                              "reward per rollout", base + ("signal", "plus", name),
                              f"add a source of kind {', '.join(kinds)}"))
    return out


@rule("rollout_filter")
def rollout_filter(spec, segment):
    """A filter acts on rollouts (a segment must sample some) and equal groups are judged by a reward source."""
    from composer.filters import filter_source
    from composer.checks.terms import rolls_out

    flt = spec.rollout.filter
    if not flt.active or (segment == "base" and spec.stages):
        return []
    if not rolls_out(spec):
        return [_d("rollout_filter", "rollout.filter acts on the step's rollouts, and no term of this segment samples "
                   "any", ("rollout", "filter"), "remove rollout.filter, or add a term that trains on rollouts")]
    if flt.equal_groups == "drop":
        src = filter_source(flt, spec)
        if src is None or src not in spec.sources or "sequence_reward" not in type(spec.sources[src]).provides:
            return [_d("rollout_filter", "equal_groups: drop needs a reward source to compare the rollouts of a prompt"
                       + (f", and '{src}' gives no reward" if src else ""), ("rollout", "filter", "source"),
                       "set rollout.filter.source to an outcome_reward source")]
    return []


@rule("off_policy_sequences_trained")
def off_policy_sequences_trained(spec, segment):
    """A distillation signal's sequences the policy did not write are `demonstration` tokens: an objective
    that does not train on them would sample and score them for nothing."""
    out = []
    for base, sig, obj in _pairs_with_paths(spec):
        if sig is None or obj is None or "off_policy" not in type(sig).model_fields or sig.off_policy == "none":
            continue
        if "demonstration" not in obj.loss_tokens:
            out.append(_d("off_policy_sequences_trained", f"off_policy: {sig.off_policy} puts sequences the policy did "
                          "not write into this term as demonstration tokens, and the objective's loss_tokens "
                          f"({', '.join(obj.loss_tokens)}) leave them out", base + ("objective", "loss_tokens"),
                          f"add demonstration: loss_tokens: [{', '.join([*obj.loss_tokens, 'demonstration'])}]"))
    return out


@rule("gate_under_filter")
def gate_under_filter(spec, segment):
    """A gate sees the groups rollout.filter kept. With `equal_groups: drop` every kept group holds both outcomes
    (DAPO's dynamic sampling), so a gate that selects only groups where every rollout failed (group_success_at_most:
    0, or outcome: failure with sibling_success: false) leaves its term nothing, except on steps where the refill
    ran out of rounds and filled up with dropped prompts."""
    if spec.rollout.filter.equal_groups != "drop":
        return []
    out = []
    for i, t in enumerate(spec.terms or []):
        g = t.gate
        if g is None:
            continue
        all_failed = g.group_success_at_most == 0 or (g.outcome == "failure" and g.sibling_success is False)
        if all_failed:
            capped = spec.rollout.filter.max_rounds is not None
            out.append(_d("gate_under_filter", "the gate selects rows of groups where no rollout succeeded, and "
                          "rollout.filter.equal_groups: drop removes exactly those groups before any gate reads the "
                          "step: the term trains on nothing" + (f", except on steps whose {spec.rollout.filter.max_rounds} "
                          "refill round(s) run out and fill up with dropped prompts" if capped else ""),
                          ("terms", i, "gate"), "drop the filter (equal_groups: keep), or gate on something a kept "
                          "group can hold (outcome: failure alone selects the failed rows of mixed groups)",
                          severity="warning"))
    return out


@rule("term_gates")
def term_gates(spec, segment):
    """A gate reads the step's rollout: it needs one, an outcome_reward source that decides success, and a
    term whose batch holds the rollout's rows when it tests a row's own facts."""
    from composer.gates import gate_source
    from composer.checks.terms import rolls_out

    out = []
    for i, t in enumerate(spec.terms or []):
        g = t.gate
        if g is None:
            continue
        path = ("terms", i, "gate")
        rewards = sorted(n for n, s in spec.sources.items() if s.kind_name() == "outcome_reward")
        src = gate_source(g, spec)
        if src is None or src not in spec.sources or spec.sources[src].kind_name() != "outcome_reward":
            where = path + (("source",) if g.source is not None else ())
            if g.source is not None:
                msg = f"the gate's source '{g.source}' is not an outcome_reward source"
            elif rewards:
                msg = f"the gate does not say which outcome_reward source decides success ({', '.join(rewards)})"
            else:
                msg = "the gate decides success with an outcome_reward source, and the spec has none"
            hint = (f"set source: to one of {', '.join(rewards)}" if rewards else
                    "add one under sources, e.g. verifier: {kind: outcome_reward}")
            out.append(_d("term_gates", msg, where, hint))
        if not rolls_out(spec):
            out.append(_d("term_gates", "a gate selects rows by facts of the step's rollout, and no term of this "
                          "segment samples rollouts", path,
                          "add a term that trains on rollouts (e.g. a reward signal with grpo), or remove the gate"))
        elif (t.signal.makes_batch or t.signal.targets_rows or getattr(t.signal, "off_policy", "none") != "none") \
                and g.row_facts():
            out.append(_d("term_gates", f"{', '.join(g.row_facts())} test a rollout's own row, but this term trains "
                          f"on rows its {t.signal.kind_name()} signal builds (one per prompt), not on the rollout",
                          path + (g.row_facts()[0],),
                          "gate it by its prompt's rollouts: group_success_at_most / group_success_above"))
    return out


@rule("phases_run")
def phases_run(spec, segment):
    """A phase that starts at or after train.steps never runs, and one whose `until` lies beyond it is cut
    short (a guide meant to switch off never does). Warnings here; `validate_loaded` makes them errors
    unless train.steps came from a command-line override (a quick `train.steps=3` run)."""
    if segment != "base" or not spec.phases:
        return []
    out, start, steps = [], 0, spec.train.steps
    for i, ph in enumerate(spec.phases):
        if start >= steps:
            out.append(_d("phases_run", f"phase {i} starts at step {start}, but the run has train.steps = "
                          f"{steps}: it never runs", ("phases", i),
                          "raise train.steps, or move the phase's `until`", severity="warning"))
        elif ph.until > steps:
            out.append(_d("phases_run", f"phase {i} runs until step {ph.until}, beyond the run's last step "
                          f"(train.steps = {steps}): it is cut at step {steps}", ("phases", i, "until"),
                          f"set its `until` to at most {steps}, or raise train.steps", severity="warning"))
        start = max(start, ph.until)
    return out


def check(spec, segment: str) -> list[Diagnostic]:
    out = []
    for fn in RULES.values():
        out.extend(fn(spec, segment))
    return out


@rule("buffer_needs_reuse")
def buffer_needs_reuse(spec, segment):
    """`sync.clear_buffer` acts only on the stored rollouts of `sync.reuse`: without reuse every step samples
    fresh rollouts from the (lagged) engine and trains on them once, so no rollout outlives its step and a
    sync has nothing to clear. Set explicitly without reuse, it would describe a buffer that does not run."""
    if spec.sync.reuse or "clear_buffer" not in spec.sync.model_fields_set:
        return []
    return [_d("buffer_needs_reuse",
               "sync.clear_buffer does nothing without sync.reuse: every step samples fresh rollouts from the "
               "rollout weights and trains on them once, so no stored rollout is left for a sync to clear",
               ("sync", "clear_buffer"),
               "remove clear_buffer (the default streaming run already trains each rollout once), or set "
               "sync.reuse: true to sample once per sync interval into a buffer that the steps reuse")]


from composer.checks import names as _names  # noqa: E402,F401  (registers names_are_words)


@rule("freeze_policy_needs_critic")
def freeze_policy_needs_critic(spec, segment):
    """train.freeze_policy (VAPO's value pre-training) freezes the policy so that a learned critic trains alone: a
    segment without a critic of its own network would train nothing."""
    if not spec.train.freeze_policy:
        return []
    critics = [(base, obj.value_model()) for base, _sig, obj in _pairs_with_paths(spec)
               if obj is not None and obj.value_model() is not None]
    if not critics:
        return [_d("freeze_policy_needs_critic", "train.freeze_policy freezes the policy so that a learned critic "
                   "trains alone (value pre-training), and no term here has a critic: nothing would learn",
                   ("train", "freeze_policy"), "add a ppo term (its critic learns on the frozen policy's rollouts), "
                   "or remove train.freeze_policy")]
    if not any(c.separate for _b, c in critics):
        base = critics[0][0]
        return [_d("freeze_policy_needs_critic", "train.freeze_policy: this critic is a head on the policy's network "
                   "(network: shared), trained through the policy's loss, which a frozen policy does not have",
                   base + ("objective", "critic", "network"), "use critic.network: own (its own value model)")]
    return []


@rule("environment_tokens_never_loss")
def environment_tokens_never_loss(spec, segment):
    """No objective trains on tokens an environment wrote (composer/origins.py NEVER_LOSS)."""
    from composer.origins import NEVER_LOSS

    out = []
    for base, _sig, obj in _pairs_with_paths(spec):
        bad = [o for o in getattr(obj, "loss_tokens", None) or [] if o in NEVER_LOSS]
        if bad:
            keep = [o for o in obj.loss_tokens if o not in NEVER_LOSS] or ["policy"]
            out.append(_d("environment_tokens_never_loss", f"loss_tokens names {', '.join(bad)}: "
                          f"{NEVER_LOSS[bad[0]]}", base + ("objective", "loss_tokens"),
                          f"leave it out: loss_tokens: [{', '.join(keep)}]"))
    return out


@rule("environment_fits_rollout")
def environment_fits_rollout(spec, segment):
    """An active rollout.environment needs rollouts the guide leaves to the policy (guide none: the episode is the
    row's program) and a term that trains on rollouts (SFT on references samples nothing for it to answer); its
    python tool needs the code sandbox's Linux namespaces."""
    from composer.checks.terms import rolls_out

    env = spec.rollout.environment
    if not env.active:
        return []
    where = ("rollout", "environment")
    out = []
    if not rolls_out(spec):
        signals = ", ".join(sorted({sig.kind_name() for _b, sig, _o in _pairs_with_paths(spec) if sig is not None}))
        out.append(_d("environment_fits_rollout", f"rollout.environment {env.kind_name()}: this spec samples no "
                      f"rollouts (its {signals} signal trains on a batch it builds itself, e.g. SFT on references), so "
                      "no episode ever runs", where + ("kind",),
                      "remove rollout.environment, or train on rollouts (signal: {kind: reward, source: ...} with "
                      "objective: {kind: grpo})"))
    if not spec.rollout.guide.plain:
        out.append(_d("environment_fits_rollout", f"rollout.environment {env.kind_name()} with guide "
                      f"{spec.rollout.guide.kind_name()}: the guide writes each rollout's program itself, and an "
                      "episode is a program of its own (policy and environment turns); the two do not compose",
                      where + ("kind",), "use guide: {kind: none} with an environment, or drop the environment"))
    if env.runs_code:
        import shutil
        import sys

        if not sys.platform.startswith("linux") or shutil.which("unshare") is None:
            out.append(_d("environment_fits_rollout", "the python tool runs programs in the code sandbox, which needs "
                          f"Linux namespaces and `unshare` (this machine: {sys.platform}, unshare "
                          f"{'missing' if shutil.which('unshare') is None else 'found'}): code never runs without it",
                          where + ("tools",), "drop python from tools (keep calculator), or run on Linux with "
                          "util-linux's unshare", "warning"))
    return out


@rule("environment_feedback_needs_environment")
def environment_feedback_needs_environment(spec, segment):
    """A feedback source that reads the environment's messages (detail: environment) needs an active environment."""
    if spec.rollout.environment.active:
        return []
    return [_d("environment_feedback_needs_environment", f"source '{name}' reads the environment's messages (detail: "
               "environment), and this spec has no rollout.environment: it would never have a text",
               ("sources", name, "detail"), "add rollout.environment (e.g. {kind: tools}), or use detail: step")
            for name, src in spec.sources.items() if getattr(src, "detail", None) == "environment"]


@rule("turn_reward_weight_acts")
def turn_reward_weight_acts(spec, segment):
    """turn_reward_weight adds per-turn rewards an environment returns; one whose answers never carry a reward (the
    tools environment) leaves it nothing to add (a warning)."""
    env = spec.rollout.environment
    if not env.active or not getattr(env, "turn_reward_weight", 0.0) or type(env).turn_rewards:
        return []
    return [_d("turn_reward_weight_acts", f"rollout.environment {env.kind_name()} returns no per-turn reward, so "
               f"turn_reward_weight {env.turn_reward_weight:g} adds nothing", ("rollout", "environment",
                                                                             "turn_reward_weight"),
               "remove turn_reward_weight (the verifier's reward of the final answer is the row's reward)", "warning")]
