"""SFT signal: teacher-forced targets, from a reference solution, from guided rollouts (InT), or the policy's own
rollouts of the step (`rollouts`: with a gate `outcome: success`, VAPO's positive-example NLL, Yue et al. 2025, arXiv
2504.05118, section 3.3: L = -(1/|T|) sum over the tokens of the step's correct rollouts of log pi(y_t), weight 0.1)."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field, model_validator

from composer.contract import Signal
from composer.registry import register


ROLLOUTS = "rollouts"  # target: the policy's own rollouts of the step


@register("signal")
class SftSignal(Signal):
    """Demonstrations as training targets: a reference solution, `guided` (policy prefix + intervention, InT), or
    `rollouts` (the policy's own responses of the step, whole: self-imitation; a term gate picks which, e.g. VAPO's
    NLL on correct rollouts with `gate: {outcome: success}`)."""

    kind: Literal["sft"] = Field("sft", description="Component kind.")
    target: str = Field(..., description="A reference_solution source; `guided`: the policy prefix plus the intervention of guided rollouts, truncated after it; or `rollouts`: the policy's own responses of the step, whole (the rollout the other terms see; a term gate chooses which rows, VAPO: `gate: {outcome: success}`).")
    filter_samples: int = Field(8, ge=0, description="With `guided`: keep a target only if at least one of this many continuations from it succeeds (InT used 32); 0 keeps all.")
    targets: Literal["offline", "online"] = Field("offline", description="With `guided`: `offline` (InT as published) builds the targets once, when the segment starts, from the weights at that point: rollout.samples_per_prompt attempts at each of `problems` training problems, the guide's interventions on the failed ones, the filters; cached in the run folder, then SFT on them. `online` builds them from every step's rollouts by the weights being trained.")
    problems: int | None = Field(None, ge=1, description="With `targets: offline`: training problems the targets are built from (default: the segment's steps x train.prompts_per_step, the problems an online run would see).")
    leak_filter: bool = Field(True, description="With `guided`: drop an intervention that contains the gold answer (InT's leakage filter: the answer as a standalone term of its text), counted as sft_leaks; the next proposal is tried.")
    temperature: float = Field(1.0, gt=0, allow_inf_nan=False, description="Softmax temperature of the cross-entropy (logits / temperature). 1 is plain SFT (InT's stage 1, whatever the temperature its attempts were sampled at).")

    refs: ClassVar = {"target": ("reference_solution",)}
    provides: ClassVar = ("sft_target",)

    @model_validator(mode="after")
    def _settings_apply(self):
        """A setting that would not act is refused: the guided-target settings on a reference target, and
        `problems` with online targets."""
        guided_only = {"filter_samples", "targets", "problems", "leak_filter"} & self.model_fields_set
        if self.target != "guided" and guided_only:
            what = ("the policy's own rollouts" if self.target == ROLLOUTS else f"the reference '{self.target}'")
            raise ValueError(f"{', '.join(sorted(guided_only))} apply to `target: guided` only (this signal "
                             f"trains on {what})")
        if self.target == ROLLOUTS and "temperature" in self.model_fields_set:
            raise ValueError("temperature: with `target: rollouts` the cross-entropy reads the rollout's own forward "
                             "at the sampler's temperature (rollout.temperature), shared with the other terms")
        if self.targets == "online" and "problems" in self.model_fields_set:
            raise ValueError("`problems` applies to `targets: offline` (online targets come from each step's "
                             "rollouts)")
        return self
    usage: ClassVar[str] = "target"

    def openrlhf_trainer(self) -> str | None:
        """A reference target is a fixed set of demonstrations: OpenRLHF's train_sft runs it (this class only);
        guided targets are built from the step's rollouts: the composer's step."""
        return "sft" if type(self) is SftSignal and self.target not in ("guided", ROLLOUTS) else None

    def ref_names(self) -> dict[str, list[str]]:
        return {} if self.target in ("guided", ROLLOUTS) else {"target": [self.target]}

    @property
    def makes_batch(self) -> bool:
        """A reference target, or offline guided targets, need no rollout at each step: the batch is the
        demonstrations themselves. The policy's own rollouts (`rollouts`) are the step's rollout."""
        if self.target == ROLLOUTS:
            return False
        return self.target != "guided" or self.targets == "offline"

    @property
    def builds_ahead(self) -> bool:
        return self.target == "guided" and self.targets == "offline"

    @property
    def loss_temperature(self) -> float | None:
        """Cross-entropy at `temperature` (1: plain SFT), whatever the sampling temperature of the attempts; on the
        policy's own rollouts, the rollout's forward at the sampler's temperature (None)."""
        return None if self.target == ROLLOUTS else self.temperature

    def start(self, ctx) -> None:
        """Offline InT targets: built once from the weights at the segment's start (see `offline_targets`)."""
        if self.builds_ahead:
            offline_targets(ctx, self, build=True)

    def rollouts_ahead(self, spec, steps: int) -> int:
        """Offline targets: rollout.samples_per_prompt attempts at each of `problems` problems (default: the
        segment's steps x prompts_per_step). The proposals and continuations depend on how many attempts fail."""
        if not self.builds_ahead:
            return 0
        return (self.problems or steps * spec.train.prompts_per_step) * spec.rollout.samples_per_prompt

    def origins(self, guide) -> set[str]:
        if self.target == ROLLOUTS:
            return {"prompt", "policy", *guide.writes_now()}
        if self.target != "guided":
            return {"prompt", "demonstration"}
        return {"prompt", "policy", *guide.writes_now()}

    def describe(self, spec) -> str:
        if self.target == ROLLOUTS:
            return ("SFT on the policy's own rollouts of the step (each response whole, teacher-forced on the "
                    "tokens it sampled; a term gate picks the rows)")
        if self.target != "guided":
            return f"SFT targets from '{self.target}' (teacher-forced; no rollout)"
        if self.builds_ahead:
            n = self.problems or "steps x prompts_per_step"
            return (f"SFT on guided targets built once at the start from {n} problems x "
                    f"{spec.rollout.samples_per_prompt} attempts (policy prefix + intervention; teacher-forced)")
        return "SFT targets from guided rollouts (policy prefix + intervention)"

    def reference_targets(self, rollout, rows: list[int]) -> list | None:
        """The referee's targets (DESIGN.md section 10) with `target: rollouts`: row i of the term's batch is row
        rows[i] of the step's recorded rollout, written again as (tokens, origins) of its real (non-padding) positions,
        so the cross-entropy is teacher-forced on what the policy sampled. None for the other targets (references and
        InT's targets are checked as the losses' inputs)."""
        if self.target != ROLLOUTS:
            return None
        out = []
        for j in rows:
            real = rollout.attention_mask[j].bool()
            out.append((rollout.tokens[j][real].tolist(), rollout.origin[j][real].tolist()))
        return out

    def make_batch(self, ctx, examples):
        """prompt + the reference solution + EOS per example, the target tokens of origin `demonstration`; a
        conversation (a `messages` row): its assistant turns, each through its end of turn, are the demonstration
        tokens, the other turns prompt tokens; offline guided targets: the next train.prompts_per_step of the
        cached targets."""
        from composer.protocol import Trace
        from composer.trajectory import assemble

        if self.builds_ahead:
            return offline_batch(ctx, self, examples)

        ref = ctx.source(self.target)
        traces = []
        for ex in examples:
            if ex.conversation is not None:  # a messages row: every assistant turn (composer/conversations.py)
                from composer.conversations import trace as conversation_trace

                traces.append(conversation_trace(ctx, ex))
                continue
            trace = Trace(ctx.prompt_ids(ex))
            trace.add(ctx.encode(ref.example_text(ex)) + [ctx.eos_id], "demonstration")
            traces.append(trace)
        batch = assemble(traces, list(examples), list(range(len(examples))), ctx.pad_id)
        batch.info["temperature"] = self.temperature
        return batch

    def apply(self, ctx, batch):
        if self.target == "guided" and not self.builds_ahead:
            return guided_targets(ctx, batch, self.filter_samples, self.leak_filter, self.temperature)
        return batch

    def ahead_program(self, ctx, example, index: int, n: int):
        return attempt_program(ctx, self, example, index, n)

    def ahead_targets(self, examples: list, results: list, n: int) -> tuple[dict, dict]:
        return collect_targets(examples, results, n)

    @property
    def targets_rows(self) -> bool:
        return self.target == "guided" and not self.builds_ahead

    def row_target(self, ctx, example, trace):
        """One row's InT target (see `guided_targets`): (the trace cut after its intervention, weight 1 when
        kept), or weight 0 for a row without intervention or failing the filter."""
        if not self.targets_rows:
            return None
        return row_target_program(ctx, example, trace, self.filter_samples, self.leak_filter)


def cut_after_intervention(trace):
    """The trace up to and including its last intervention token (a new Trace), or None without one."""
    from composer.protocol import Trace

    last = max((i for i, p in enumerate(trace.pieces) if p.origin == "guide_intervention"), default=None)
    if last is None:
        return None
    out = Trace(list(trace.prompt), control=False, guided=True, tag=trace.tag, notes=dict(trace.notes))
    for p in trace.pieces[: last + 1]:
        out.add(p.tokens, p.origin, p.logprobs)
    return out


def keep_program(ctx, example, trace, filter_samples: int, facts: dict | None = None):
    """Program: whether one of `filter_samples` continuations of `trace` (no reference shown) succeeds. With
    `facts`, adds the continuations sampled and those that succeeded (`continuations`, `successes`) and notes
    this test's successes (`last_successes`)."""
    from components.guides.intervention import successes
    from composer.protocol import Sample

    if filter_samples <= 0:
        return True
    gens = yield Sample(trace.tokens, ctx.max_new_tokens - len(trace.response), n=filter_samples, purpose="filter")
    texts = [ctx.decode(trace.response + g.tokens) for g in gens]
    ok = sum(successes(ctx, [example] * len(texts), texts))
    if facts is not None:
        facts["continuations"] = facts.get("continuations", 0) + len(texts)
        facts["successes"] = facts.get("successes", 0) + ok
        facts["last_successes"] = ok
    return ok > 0


def contains_answer(text: str, answer: str | None) -> bool:
    """InT's leakage filter: the gold answer occurs in `text` as a standalone term (not as part of a longer
    number or word: '12' is not in '123', it is in 'x = 12.')."""
    import re

    a = (answer or "").strip()
    return bool(a) and re.search(rf"(?<![0-9A-Za-z]){re.escape(a)}(?![0-9A-Za-z]|\.[0-9])", text) is not None


def leaks(ctx, example, trace) -> bool:
    """The intervention contains the gold answer (InT drops every such proposal)."""
    text = ctx.decode([t for p in trace.pieces if p.origin == "guide_intervention" for t in p.tokens])
    return contains_answer(text, example.answer)


def target_cuts(ctx, trace) -> list:
    """The candidate targets of a finished rollout, in order: with InT's proposals noted on the trace
    (components/guides/intervention.py `propose_pending`), one per proposal: the attempt's steps before its
    first error (policy tokens, with their log-probs) + its intervention; otherwise the trace cut right after
    its last intervention token."""
    from components.guides.intervention import correction_ids
    from composer.protocol import Trace

    proposals, attempt = trace.notes.get("proposals"), trace.notes.get("attempt")
    if not trace.guided:
        return []
    if not proposals or attempt is None:
        cut = cut_after_intervention(trace)
        return [] if cut is None else [cut]
    guide, out = ctx.spec.rollout.guide, []
    for p in proposals:
        t = Trace(list(trace.prompt), control=False, guided=True, tag=trace.tag)
        t.add(attempt["tokens"][: p["keep"]], "policy", attempt["logprobs"][: p["keep"]])
        t.add(correction_ids(ctx, guide, p["correction"], ctx.max_new_tokens - p["keep"]), "guide_intervention")
        out.append(t)
    return out


def target_program(ctx, example, trace, filter_samples: int, leak_filter: bool = True, facts: dict | None = None):
    """Program: InT's target of a finished rollout -> (status, cut): `none` (no intervention), `leak` (every
    intervention contains the gold answer), `filtered` (no continuation from any of the others succeeds) or
    `kept`: the first candidate (`target_cuts`: one per proposal, in order) that passes both filters. Every
    InT path uses it (online and offline, on both backends). With `facts`, it also counts what each filter
    saw: candidates dropped as leaks (`leaked`), candidates tested by continuations (`tested`, and
    keep_program's counts) and, when one is kept, how many of its continuations succeeded (`kept_successes`
    of `kept_continuations`)."""
    cuts = target_cuts(ctx, trace)
    if not cuts:
        return "none", None
    facts = {} if facts is None else facts
    status = "leak"
    for cut in cuts:
        if leak_filter and leaks(ctx, example, cut):
            facts["leaked"] = facts.get("leaked", 0) + 1
            continue
        status = "filtered"
        facts["tested"] = facts.get("tested", 0) + 1
        if (yield from keep_program(ctx, example, cut, filter_samples, facts)):
            facts["kept_successes"] = facts.get("last_successes", 0)
            facts["kept_continuations"] = max(filter_samples, 0)
            return "kept", cut
    return status, None


def row_target_program(ctx, example, trace, filter_samples: int, leak_filter: bool = True):
    status, cut = yield from target_program(ctx, example, trace, filter_samples, leak_filter)
    return (cut, 1.0) if status == "kept" else (trace, 0.0)


def guided_targets(ctx, batch, filter_samples: int, leak_filter: bool = True, temperature: float = 1.0):
    """InT's SFT targets (Yang et al. 2026, arXiv 2601.14209, pipeline steps 4-5), from this step's rollouts.

    From each guided row: prompt + policy prefix + intervention, cut right after the last intervention
    token (the continuation is dropped; no EOS is trained). Kept only if at least one of
    `filter_samples` continuations sampled from it (without the reference) succeeds (`keep_program`, the
    OpenRLHF agent's filter too); 0 keeps all. Returns a new TrajectoryBatch of the kept rows (origins
    policy + guide_intervention). With none kept, the rows are cut to their prompts and weighted 0: the
    loss is exactly zero.
    """
    from composer.lazy import torch
    from composer.origins import CODE
    from composer.protocol import Trace
    from composer.trajectory import assemble

    cands = candidates(batch)
    cands, counts = kept_targets(ctx, batch, cands, filter_samples, leak_filter)
    ctx.log(**counts)
    empty = not cands
    if empty:  # zero loss without crashing: prompt-only rows, weight 0
        i = 0
        plen = int((batch.origin[i] == CODE["prompt"]).sum())
        cands = [(i, Trace(batch.tokens[i, :plen].tolist()))]
    out = assemble([t for _, t in cands], [batch.examples[i] for i, _ in cands],
                   [int(batch.prompt_index[i]) for i, _ in cands], ctx.pad_id)
    out.info["temperature"] = temperature  # the cross-entropy's (signal.temperature), not the sampler's
    if empty:
        out.seq_weight = torch.zeros(out.size)
    return out


def candidates(batch) -> list:
    """(row, trace cut right after its last intervention token) of every guided row with an intervention."""
    from composer.lazy import torch
    from composer.origins import CODE, ORIGINS
    from composer.protocol import Trace

    inter = batch.origin == CODE["guide_intervention"]  # [B, T]
    guided = batch.guided if batch.guided is not None else torch.zeros(batch.size, dtype=torch.bool)  # [B]
    known = batch.known_mask
    out = []
    for i in range(batch.size):
        if not (bool(guided[i]) and bool(inter[i].any())):
            continue
        cut = int(inter[i].nonzero().max()) + 1
        ids, org = batch.tokens[i, :cut].tolist(), batch.origin[i, :cut].tolist()
        lps, kn = batch.behavior_logprobs[i, :cut].tolist(), known[i, :cut].tolist()
        plen = sum(o == CODE["prompt"] for o in org)
        notes = batch.notes[i] if i < len(batch.notes or []) and isinstance(batch.notes[i], dict) else {}
        trace = Trace(ids[:plen], control=False, guided=True, notes=dict(notes))
        for t in range(plen, cut):
            trace.add([ids[t]], ORIGINS[org[t]], [lps[t]] if kn[t] else None)
        out.append((i, trace))
    return out


def kept_targets(ctx, batch, cands: list, filter_samples: int, leak_filter: bool) -> tuple[list, dict]:
    """The candidates that survive the answer-leak filter and the continuation filter, and the counts."""
    guided = int(batch.guided.sum()) if batch.guided is not None else 0
    results = ctx.run([target_program(ctx, batch.examples[i], t, filter_samples, leak_filter) for i, t in cands])
    kept = [(i, cut) for (i, _t), (status, cut) in zip(cands, results) if status == "kept"]
    leaked = sum(status == "leak" for status, _ in results)
    return kept, {"sft_kept": len(kept), "sft_candidates": guided, "sft_interventions": len(cands), "sft_leaks": leaked}


# ------------------------------------------------------------------------------------ offline InT targets

def attempt_program(ctx, sig: SftSignal, example, index: int, n: int):
    """Program: attempt `index` of n at `example` with the segment's guide, then InT's target of it:
    -> (status, trace, facts); status is `none` (no intervention), `leak`, `filtered` or `kept` (trace: the
    attempt cut right after its intervention); facts: whether the attempt failed, its readable proposals and
    what the filters saw (`target_program`). Both backends build offline targets with it."""
    from components.guides.intervention import success

    trace = yield from ctx.spec.rollout.guide.row(ctx, example, index, n)
    # a reviewed attempt failed (the guide proposes only for failed ones); an unreviewed one failed if it is wrong
    failed = bool(trace.notes.get("reviews")) or not success(ctx, example, ctx.decode(trace.response))
    facts = {"failed": int(failed), "proposals": len(trace.notes.get("proposals") or [])}
    status, cut = yield from target_program(ctx, example, trace, sig.filter_samples, sig.leak_filter, facts)
    return status, cut, facts


# what collect_targets sums from attempt_program's facts (int_offline/<name> in metrics.csv)
FACTS = {"failed": "failed", "proposals": "proposals", "leaked_proposals": "leaked", "tested_proposals": "tested",
         "continuations": "continuations", "continuation_successes": "successes",
         "kept_continuations": "kept_continuations", "kept_continuation_successes": "kept_successes"}


def collect_targets(examples: list, statuses: list, n: int) -> tuple[dict, dict]:
    """{prompt: [kept traces]} and the counts, from attempt_program's results (n per example, in order):
    attempts, failed attempts, and of the failed ones those with an intervention, those whose every
    intervention stated the answer (`leaks`), those where no continuation succeeded (`filtered`) and `kept`;
    the readable proposals, those the leak filter dropped and those tested by continuations; the continuations
    and those that succeeded, over all tests and for the kept targets alone; and the kept targets' tokens
    (`target_tokens`, the response tokens SFT trains on) and their intervention tokens."""
    targets: dict[str, list] = {}
    counts = {"problems": len(examples), "attempts": len(statuses), "failed": 0, "interventions": 0, "leaks": 0,
              "filtered": 0, "kept": 0, **{k: 0 for k in FACTS if k != "failed"}, "target_tokens": 0,
              "intervention_tokens": 0}
    for k, (status, trace, facts) in enumerate(statuses):
        counts["interventions"] += status != "none"
        counts["leaks"] += status == "leak"
        counts["filtered"] += status == "filtered"
        counts["kept"] += status == "kept"
        for name, fact in FACTS.items():
            counts[name] += facts.get(fact, 0)
        if status == "kept":
            targets.setdefault(examples[k // n].prompt, []).append(trace)
            counts["target_tokens"] += len(trace.response)
            counts["intervention_tokens"] += sum(len(p.tokens) for p in trace.pieces if p.origin == "guide_intervention")
    if not counts["kept"]:
        import logging

        logging.getLogger("composer").warning(
            "InT: the SFT stage has no target and will train on nothing: %d problems, %d attempts, %d failed, %d "
            "with an intervention, %d whose every intervention contains the answer (leak filter), %d where no "
            "continuation succeeded (filter_samples); more attempts (problems, samples_per_prompt), more proposals "
            "or a larger filter_samples may find some", counts["problems"], counts["attempts"], counts["failed"],
            counts["interventions"], counts["leaks"], counts["filtered"])
    return targets, counts


def _cache_file(ctx):
    return None if ctx.run_dir is None else ctx.run_dir / "int_targets" / f"{ctx.segment or 'main'}.jsonl"


def offline_targets(ctx, sig: SftSignal, build: bool = False) -> dict:
    """InT's targets as published (Yang et al. 2026, arXiv 2601.14209, pipeline steps 1-5), built once.

    At the segment's start (`build`): for each training problem the segment's steps will draw (peeked,
    the data position does not move), rollout.samples_per_prompt attempts with the weights at that point
    and the segment's guide (the proposer rewrites the first wrong step of a failed attempt, shown its
    declared context), each intervention cut right after it, kept when it does not state the final answer
    (`leak_filter`) and a continuation from it succeeds (`filter_samples`). Kept targets go to
    <run>/int_targets/<segment>.jsonl and are read back from there after a resume; the attempts' tokens
    count in the run's cost columns. -> {prompt: [target traces]}.
    """
    key = (ctx.segment, sig.model_dump_json())
    if key in ctx.memo.targets:
        return ctx.memo.targets[key]
    path = _cache_file(ctx)
    if path is not None and (path.exists() or path.is_symlink()):
        targets = _load(path, ctx, sig)
    elif build:
        targets = _build(ctx, sig, path)
    else:
        from composer.errors import DataError

        raise DataError(f"InT's offline targets of segment '{ctx.segment}' were never built and are not in "
                           f"{path}: resume from a checkpoint taken after the segment started")
    ctx.memo.targets[key] = targets
    return targets


def _build(ctx, sig: SftSignal, path) -> dict:
    from composer import files

    n = ctx.spec.rollout.samples_per_prompt
    problems = ctx.peek_prompts(sig.problems or (ctx.segment_end - ctx.segment_start) * ctx.spec.train.prompts_per_step)
    ctx.run(list(ctx.spec.rollout.guide.prepare(ctx, problems)))
    ctx.costs["policy_samples"] += len(problems) * n  # the attempts (proposals and continuations count as served)
    statuses = ctx.run([attempt_program(ctx, sig, ex, i, n) for ex in problems for i in range(n)])
    targets, counts = collect_targets(problems, statuses, n)
    ctx.log(**{f"int_offline/{k}": v for k, v in counts.items()})
    ctx.record("int_targets", targets=targets, counts=counts)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        body = "".join(_line(prompt, t) for prompt, ts in targets.items() for t in ts)
        files.write_text(path, _header(body, ctx, sig) + body)
    return targets


MAX_TARGETS_BYTES = 1 << 30  # a cache file this large was not written by a run of this size


def _fingerprint(ctx, sig: SftSignal) -> str:
    import hashlib

    return hashlib.sha256(f"{ctx.segment}\0{sig.model_dump_json()}".encode()).hexdigest()


def _header(body: str, ctx, sig: SftSignal) -> str:
    """The cache's first line: the digest of the rows below it and of the segment and signal that built them."""
    import hashlib
    import json

    return json.dumps({"int_targets": 1, "sha256": hashlib.sha256(body.encode()).hexdigest(),
                       "rows": body.count("\n"), "built_for": _fingerprint(ctx, sig)}) + "\n"


def _line(prompt: str, trace) -> str:
    import json

    pieces = [{"tokens": p.tokens, "origin": p.origin, "logprobs": p.logprobs} for p in trace.pieces]
    return json.dumps({"problem_prompt": prompt, "prompt": trace.prompt, "pieces": pieces}) + "\n"


def _load(path, ctx=None, sig: SftSignal | None = None) -> dict:
    """The cached targets, read back only when they are exactly what the run wrote: a regular file whose rows
    match the digest in its first line, built for this segment and signal, every row of the shape written.
    Anything else (emptied, edited, duplicated, over-long, a FIFO) stops the run with the file named."""
    import hashlib
    import json
    import os
    import stat as stat_

    from composer.errors import DataError
    from composer.protocol import Trace

    def refuse(why: str) -> DataError:
        return DataError(f"{path}: InT's cached targets {why}; they are not used (training on them would "
                         "silently train on other targets)\n    hint: start the run again in a new folder to "
                         "rebuild them", file=str(path))

    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        raise refuse(f"cannot be read ({e.strerror or e})") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat_.S_ISREG(st.st_mode):
            raise refuse("are not in a regular file")
        if st.st_size > MAX_TARGETS_BYTES:
            raise refuse(f"are {st.st_size} bytes, more than a run writes")
        raw = f.read(MAX_TARGETS_BYTES + 1)
    try:
        text = raw.decode("utf-8")
        head_line, _, body = text.partition("\n")
        head = json.loads(head_line)
    except ValueError:
        raise refuse("have no readable header (written by an older version, or edited)") from None
    if not isinstance(head, dict) or head.get("int_targets") != 1:
        raise refuse("have no header (written by an older version, or edited)")
    if head.get("sha256") != hashlib.sha256(body.encode()).hexdigest() or head.get("rows") != body.count("\n"):
        raise refuse("were changed after the run wrote them (their digest does not match)")
    if ctx is not None and sig is not None and head.get("built_for") != _fingerprint(ctx, sig):
        raise refuse("were built for another segment or signal")
    out: dict[str, list] = {}
    for i, line in enumerate(body.splitlines(), start=2):
        try:
            row = json.loads(line)
            if not (isinstance(row, dict) and isinstance(row.get("problem_prompt"), str)
                    and isinstance(row.get("prompt"), list) and isinstance(row.get("pieces"), list)):
                raise ValueError("not a target row")
            trace = Trace(row["prompt"], control=False, guided=True)
            for p in row["pieces"]:
                trace.add(p["tokens"], p["origin"], p["logprobs"])
        except (ValueError, TypeError, KeyError) as e:
            raise refuse(f"have a malformed row at line {i} ({type(e).__name__})") from None
        out.setdefault(row["problem_prompt"], []).append(trace)
    return out


def offline_batch(ctx, sig: SftSignal, examples: list):
    """The step's SFT batch: the cached targets of the step's problems (all of each problem's kept
    attempts), or a zero-loss batch of the first prompt when none of them has one."""
    from composer.lazy import torch
    from composer.protocol import Trace
    from composer.trajectory import assemble

    targets = offline_targets(ctx, sig)
    rows = [(k, ex, t) for k, ex in enumerate(examples) for t in targets.get(ex.prompt, [])]
    ctx.log(sft_kept=len(rows))
    if not rows:
        out = assemble([Trace(ctx.prompt_ids(examples[0]))], [examples[0]], [0], ctx.pad_id)
        out.seq_weight = torch.zeros(1)
    else:
        out = assemble([t for _, _, t in rows], [ex for _, ex, _ in rows], [k for k, _, _ in rows], ctx.pad_id)
    out.info["temperature"] = sig.temperature  # plain SFT at 1 by default, not the attempts' sampling temperature
    return out
