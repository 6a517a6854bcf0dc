"""Traces the policy did not write inside a group: a reference's or a teacher's trace replacing k rollouts (LUFFY)."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field

from composer.contract import Guide, ModelCall
from composer.protocol import Sample, Trace
from composer.registry import register


@register("guide")
class TracesGuide(Guide):
    """Whole traces the policy did not write inside each advantage group (mixed-policy groups; LUFFY, Yan et al.
    2025, arXiv 2504.14945: 7 rollouts + 1 DeepSeek-R1 trace per prompt).

    Of a prompt's n = rollout.samples_per_prompt rows, the first `per_group` are traces and the other n - k the
    policy's own rollouts. A trace is the `source`'s: a reference_solution source's text of the problem + EOS (a
    data column of a stronger model's traces through its `field`), or what a policy_model source (a teacher)
    writes from the policy's prompt, sampled fresh at every step. Either is cut at rollout.max_new_tokens, the room
    of a rollout. Its tokens are `demonstration` tokens (no behaviour log-prob of the policy), it is scored by the
    same reward as the rollouts, and all n rows form one advantage group, so A_i = (R_i - mean_j R_j) / std_j R_j
    runs over the mixed group. The objective says how trace tokens train: grpo's `off_policy_weight` (LUFFY's
    shaping pi / (pi + 0.1)) with `demonstration` in its loss_tokens. Trace rows are not control rows, so an
    estimator that reads control rows (`control_mean`) takes its baseline from the rollouts alone.
    """

    kind: Literal["traces"] = Field("traces", description="Component kind.")
    source: str = Field(..., description="Who wrote the traces: a reference_solution source (the problem's reference text + EOS; its `field` may name a data column of a stronger model's traces) or a policy_model source (a teacher that writes each trace from the policy's prompt, fresh every step, at the rollout temperature).")
    per_group: int = Field(1, ge=1, description="k: rows of each group that are traces (the first k of the prompt's samples_per_prompt); the rest are the policy's rollouts (LUFFY: 1 of 8).")

    refs: ClassVar = {"source": ("reference_solution", "policy_model")}
    provides: ClassVar = ("guided_tokens",)
    writes: ClassVar = ("demonstration",)

    def writer(self, spec) -> bool:
        """True when the source is a model that writes the traces (else a reference text)."""
        src = spec.sources.get(self.source)
        return src is not None and src.kind_name() == "policy_model"

    def reference_trace(self, spec, example):
        """The referee's trace of a trace row of `example` (DESIGN.md section 10): the reference text (a text source:
        its `field` of the data row when set, else the row's solution; False when there is none, the row is then
        the policy's rollout), or None when a model writes it (checked against what that model generated)."""
        src = spec.sources[self.source]
        if src.model_path is not None:
            return None
        field = getattr(src, "field", None)
        text = example.meta.get(field) if field and example.meta.get(field) is not None else example.solution
        return str(text) if text else False

    def reference_control(self, spec, batch, tokenizer=None):
        """Every row but a prompt's first `per_group` (those too when its reference has no text: then they are
        the policy's rollouts)."""
        n = spec.rollout.samples_per_prompt
        out = []
        for i in range(batch.size):
            ex = batch.examples[i] if len(batch.examples) == batch.size else batch.examples[int(batch.prompt_index[i])]
            out.append(not (i % n < self.per_group and self.reference_trace(spec, ex) is not False))
        return out

    def model_calls(self, spec) -> list[ModelCall]:
        """A policy_model source writes the traces: one generation of up to rollout.max_new_tokens each."""
        if not self.writer(spec):
            return []
        return [ModelCall(self.source, spec.rollout.max_new_tokens, "\n", spec.sources[self.source].weights,
                          sampled=True)]

    def describe(self, spec) -> str:
        what = (f"'{self.source}' writes from the policy's prompt (fresh each step)" if self.writer(spec) else
                f"the reference text of '{self.source}' + EOS")
        n = spec.rollout.samples_per_prompt
        return (f"{self.per_group} of each prompt's {n} rows are traces the policy did not write ({what}, cut at "
                f"{spec.rollout.max_new_tokens} tokens; demonstration tokens), the other {n - self.per_group} its "
                "own rollouts; all in one advantage group, the traces scored by the same reward")

    def preflight(self, ctx) -> None:
        """A reference source must have a text for some training problem (else no row would be a trace)."""
        if self.writer(ctx.spec) or not ctx.task.train:
            return
        src = ctx.source(self.source)
        if not any(src.example_text(ex) for ex in ctx.task.train[:64]):
            raise ValueError(f"rollout.guide: the traces of '{self.source}' are its reference texts, and the first "
                             f"{min(len(ctx.task.train), 64)} training problems have none; set the source's `field` "
                             "to the data column of traces (or data.solution_field)")

    # ---- the protocol ----
    def row(self, ctx, example, index: int, n: int):
        """Row `index` of n: a trace for index < per_group (a plain rollout when a reference has no text for the
        problem, noted), else the policy's own rollout."""
        prompt = ctx.prompt_ids(example)
        if index >= self.per_group:
            trace = Trace(prompt)
            [gen] = yield Sample(prompt, ctx.max_new_tokens)
            trace.add(gen.tokens, "policy", gen.logprobs)
            return trace
        if self.writer(ctx.spec):
            [gen] = yield Sample(prompt, ctx.max_new_tokens, model=self.source, purpose="teacher")
            tokens = list(gen.tokens)
        else:
            text = ctx.source(self.source).example_text(example)
            if not text:  # nothing to place: the policy's rollout, counted
                trace = Trace(prompt)
                trace.notes["trace_missing"] = True
                [gen] = yield Sample(prompt, ctx.max_new_tokens)
                trace.add(gen.tokens, "policy", gen.logprobs)
                return trace
            tokens = ctx.encode(text) + [ctx.eos_id]
        trace = Trace(prompt, control=False, guided=True)
        trace.add(tokens[: ctx.max_new_tokens], "demonstration")
        trace.notes.update(trace=self.source, trace_cut=len(tokens) > ctx.max_new_tokens)
        return trace

    def metrics(self, traces) -> dict[str, float]:
        """trace_frac: rows that are traces; trace_len: their mean tokens; trace_cut_frac: traces cut at
        max_new_tokens; trace_missing: rows meant as traces whose reference had no text (rollouts instead)."""
        rows = [t for t in traces if "trace" in t.notes]
        return {"trace_frac": len(rows) / max(len(traces), 1),
                "trace_len": sum(len(t.response) for t in rows) / max(len(rows), 1),
                "trace_cut_frac": sum(bool(t.notes["trace_cut"]) for t in rows) / max(len(rows), 1),
                "trace_missing": float(sum(bool(t.notes.get("trace_missing")) for t in traces))}
