"""What this machine adds to the Plan (explain and plan.json): one rendered example of what a run's models are
prompted with (the first usable training row read through the data binding, rendered with the prompt templates,
composer/prompts.py, and the real tokenizer's chat template), the rollout engine's note on its behaviour log-probs
and the policy's stop tokens. `machine_notes(v)` is added to `compile_plan(v)` by the commands that show or write
the Plan."""

from __future__ import annotations

from composer.prompts import PromptFormat, judge_prompt, teacher_prompt, which_template
from composer.runtime.binding import policy_format

PLACEHOLDER = {
    "sibling_success": "\u27e8a successful rollout of the same group, when there is one\u27e9",
    "feedback": "\u27e8the verifier's feedback on this rollout\u27e9",
    "reference_solution": "\u27e8no reference solution in this row\u27e9",
}


def machine_notes(v) -> dict:
    """What this machine adds to the Plan of validated spec `v`: the rollout engine's exact-log-prob note, the data
    files found and their splits (data_files: train, eval), and one rendered example of the prompts."""
    from composer.runtime.vllm_engine import engine_note

    return {"rollout_engine": engine_note(v.spec.rollout), "data_files": data_files(v.spec.data),
            "data_format": data_format(v.spec.data),
            "prompts": example_prompts(v.spec, [s.spec for s in v.segments]), "stop_tokens": stop_note(v.spec)}


def data_format(d) -> dict:
    """{"train": ..., "eval": ...}: the data format of each source that is not prompt rows, in words (messages rows:
    `messages: N conversations (M assistant turns), assistant turns trained`, composer/runtime/conversations.py); {} for
    prompt rows and the toy testbed."""
    if d.train is None:
        return {}
    from composer.runtime.conversations import summary

    out = {"train": summary(d.train, d.split, d, "train")}
    source = d.eval or (d.train if d.eval_split else None)
    if source:
        out["eval"] = summary(source, d.eval_split, d, "eval")
    return {k: v for k, v in out.items() if v}


def stop_note(spec) -> str:
    """Which tokens end the policy's responses (composer/stops.py), in words; why not, when its tokenizer does not
    load here (the run loads it and says them in its first lines)."""
    from composer.stops import for_spec

    name = spec.policy.tokenizer or spec.policy.model or "toy:student"
    if name.startswith("toy:"):  # the toy tokenizer's one eos (its specials' order); explain imports no transformers
        from composer.registry import part

        specials = tuple(part("toy.specials"))
        return f"{specials.index('<eos>')} '<eos>' (the toy tokenizer's eos)"
    try:
        from composer.runtime.models import load_tokenizer

        tok = load_tokenizer(name, trust_remote_code=bool(spec.policy.trust_remote_code))
        return for_spec(tok, spec).describe()
    except Exception as e:  # noqa: BLE001 - explain shows why; the run stops with the same error
        return f"not known here ({type(e).__name__}: {(str(e).strip().splitlines() or [''])[0]})"


def data_files(d) -> dict:
    """{"train": what data.train is and the split a run reads, "eval": the same of the evaluation source} in words
    (composer/runtime/datafiles.py `describe`); {} on the toy testbed."""
    if d.train is None:
        return {}
    from composer.runtime.datafiles import describe

    source = d.eval or (d.train if d.eval_split else None)
    return {"train": describe(d.train, d.split, "train"),
            **({"eval": describe(source, d.eval_split, "eval")} if source else {})}


def first_example(spec):
    """(example, where, task) of the first usable training row: the toy testbed's first problem, or the first
    row of data.train that loads (the whole file is not read)."""
    d = spec.data
    if d.train is None:
        from composer.registry import part

        task = part("toy.task")(tiers=tuple(d.tiers), train_tiers=tuple(d.train_tiers), eval_per_tier=1, train_per_tier=1,
                        seed=spec.train.seed, task=d.toy_task)
        return task.train[0], "the toy testbed's first training problem", task
    from pathlib import Path

    from composer.data import Task
    from composer.runtime.binding import DataError, _example, open_source

    path = Path(d.train)
    where, rows = open_source(d.train, d.split, "train")
    first = None
    for i, row in rows:
        try:
            if isinstance(row, DataError):
                raise row
            ex = _example(where, i, row, d)
        except DataError as e:
            first = first or e
            continue
        return ex, f"row {i} of {where}", Task(name=path.stem, train=[], eval={}, verifier="math")
    # no row is usable: the first one's reason (a wrong prompt_field names the fields the rows have)
    raise DataError(f"{where}: no usable row" + (f"; the first: {first}" if first else ""), file=str(d.train),
                    field=first.field if first else "", reason=first.reason if first else "")


def example_prompts(spec, segment_specs=()) -> dict:
    """One rendered example of what the run's models are prompted with, for `explain` and plan.json: the
    policy's prompt for the first training row, and for the same row every policy_model source's prompt (a
    teacher's privileged prompt, a judge's verdict prompt with the reference's first steps as the steps under
    review; posterior texts, known only from rollouts, as placeholders). {"error": why} when it cannot be
    rendered here (the run itself says why again, before training)."""
    try:
        fmt = policy_format(spec)
        example, where, task = first_example(spec)
        if example.conversation is not None:  # a messages row: the whole conversation, its trained tokens marked
            from composer.conversations import describe_example
            from composer.runtime.conversations import no_template

            if fmt.mode != "chat":
                raise ValueError(no_template(fmt, spec.data).split("\n")[0])
            example.prompt = describe_example(example, fmt, spec)
            where += " (a conversation: the tokens SFT trains between \u27e6 and \u27e7)"
        elif fmt.mode != "task":
            example.prompt = fmt.prompt(example)
    except Exception as e:  # noqa: BLE001 - explain shows why, the run stops with the same error
        from composer.runtime.binding import DataError

        out = {"error": f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0]}"}
        if isinstance(e, DataError):  # the spec's data cannot be read as declared: explain fails like the run
            from composer.runtime.binding import data_hint

            out["data_error"] = str(e)
            out["data_hint"] = data_hint(e, spec.data)
        return out
    out = {"format": fmt.to_json(), "describe": fmt.describe(), "example": where, "policy": example.prompt,
           "sources": {}}
    if example.conversation is not None:
        from composer.conversations import template_generation

        how = ("its {% generation %} blocks (return_assistant_tokens_mask)" if template_generation(fmt.tokenizer)
               else "rendering each turn's prefix")
        out["describe"] = (f"messages rows: the chat template of {fmt.tokenizer_name or 'the policy tokenizer'} renders "
                           f"each conversation{', ' + str(fmt.kwargs) if fmt.kwargs else ''}; assistant turns found by "
                           f"{how}")
    for seg in list(segment_specs) or [spec]:
        guide = seg.rollout.guide
        judges = {c.source: c for c in guide.model_calls(seg)} if hasattr(guide, "model_calls") else {}
        teachers = {getattr(sig, "teacher_source", None) for sig in _signals(seg)} - {None}
        for name, src in seg.sources.items():
            if src.kind_name() != "policy_model" or name in out["sources"] or not {name} & (teachers | set(judges)):
                continue
            try:
                out["sources"][name] = _source_prompts(task, fmt, example, seg, src, name in teachers,
                                                       judges.get(name))
            except Exception as e:  # noqa: BLE001 - shown by explain; the run's own checks stop it before training
                out["sources"][name] = {"context": list(src.context), "error": f"{type(e).__name__}: {e}"}
    return out


def _source_prompts(task, fmt: PromptFormat, example, seg, src, teacher: bool, judge) -> dict:
    """A policy_model source's example prompts: as a teacher and/or as a judge (its verdict prompt)."""
    kinds = {c: seg.sources[c].kind for c in src.context}
    texts = {c: _example_text(seg.sources[c], example) for c in src.context}
    entry = {"context": list(src.context)}
    if teacher:
        shown, note = texts, ""
        if getattr(src, "feedback_only_without_solution", False) and {"sibling_success", "feedback"} <= \
                set(kinds.values()):  # SDPO's rule: a row sees the feedback only without a sibling success
            shown = {c: (None if kinds[c] == "feedback" else t) for c, t in texts.items()}
            note = "; a row without a successful sibling sees the feedback instead"
        text = teacher_prompt(task, src, kinds, example, shown, fmt)
        entry["teacher"] = text if text is not None else example.prompt
        entry["teacher_note"] = (which_template(task, src, "teacher", kinds) + note if text is not None
                                 else "no context: the student's own prompt")
    if judge is not None:
        steps = [s for s in (example.solution or "").split(judge.step_split) if s.strip()] or ["..."]
        accepted, new = steps[:1], steps[1:3] or ["..."]
        entry["judge"] = judge_prompt(task, src, kinds, example, accepted, new, judge.step_split, texts, fmt)
        entry["judge_note"] = which_template(task, src, "judge", kinds)
    return entry


def _signals(spec):
    from composer.checks.graph import signal_objective_pairs

    return [sig for sig, _obj in signal_objective_pairs(spec) if sig is not None]


def _example_text(src, example) -> str:
    from composer.contract import Source

    per_problem = type(src).example_text is not Source.example_text  # the source has text of the problem alone
    text = src.example_text(example) if per_problem else None
    return text if text is not None else PLACEHOLDER.get(src.kind_name(), f"\u27e8{src.kind_name()}\u27e9")
