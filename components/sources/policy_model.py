"""A policy model as a source: an external teacher or judge, or the policy itself with privileged context.

As a teacher it scores the student's own rollouts and never generates: for each row it builds a
teacher prompt (the problem plus the privileged texts of its `context` sources), appends exactly the
student's response token ids, and takes log pi_T(y_t | teacher prompt, y_<t) in one forward pass.
  - OPD (Lu / Thinking Machines 2025): an external teacher, no context, the student's own prompt.
  - OPSD (Zhao et al. 2026, arXiv 2601.18734): `model: self` shown the reference solution.
  - SDPO (Hübotter et al. 2026, arXiv 2601.20802): `model: self` (EMA weights) shown a successful
    sibling, else the verifier's feedback; rows with neither get s_i = 0.
"""

from __future__ import annotations

import string
from typing import ClassVar, Literal

from pydantic import Field, model_validator

from composer.lazy import torch
from composer.registry import Component, register

TEXT_SOURCES = ("reference_solution", "feedback", "sibling_success")

# Default teacher prompts for tasks without their own templates (ALGORITHMS.md sections 4 and 5).
OPSD_TEMPLATE = (
    "{problem}\n\nHere is a reference solution to this problem:\n{solution}\n\n\nAfter understanding the reference "
    "solution and the rationale behind each step, now articulate your own step-by-step reasoning that derives the "
    "same final answer to the problem below:\n\nPlease reason step by step, and put your final answer within \\boxed{{}}."
)
SDPO_TEMPLATE = "{prompt}{solution}{feedback}\n\nCorrectly solve the original question."
SDPO_SOLUTION = "\nCorrect solution:\n\n{text}\n"
SDPO_FEEDBACK = "\nThe following is feedback from your unsuccessful earlier attempt:\n\n{text}\n"
# source kind -> the name of its text in the task's templates (toy: TEMPLATES in components/tasks/toy.py)
TEMPLATE_OF = {"reference_solution": "reference", "sibling_success": "sibling", "feedback": "feedback"}
FIELD_OF = {"reference_solution": "solution", "sibling_success": "sibling", "feedback": "feedback"}


@register("sources")
class PolicyModel(Component):
    """A language model that scores (teacher) or reviews (judge) the policy's rollouts; never generates rollouts itself."""

    kind: Literal["policy_model"] = Field("policy_model", description="Component kind.")
    model: str = Field(..., description="Model id or directory, `self` (the trained policy's network), or `toy:teacher` / `toy:student` (the toy testbed's checkpoints).")
    weights: Literal["current", "initial", "ema"] = Field("current", description="With `model: self`: the live weights, a frozen copy of the initial weights, or an exponential moving average.")
    ema_rate: float = Field(0.05, gt=0, le=1, description="EMA update rate: theta_T <- (1 - rate) theta_T + rate theta after every optimiser step (SDPO: 0.05).")
    context: list[str] = Field(default_factory=list, description="Textual sources shown to this model in its prompt (reference_solution, feedback, sibling_success).")
    template: str | None = Field(None, description="Prompt template with {problem} (or {prompt}) and one {<source name>} per context source; default: the task's templates, else the OPSD/SDPO templates.")
    shares_tokenizer: bool = Field(True, description="Declares that this model uses the policy's tokenizer (distillation needs it; checked for real when models load).")
    temperature: float = Field(1.0, gt=0, description="Logits are divided by this before scoring (OPSD: the sampling temperature).")
    feedback_only_without_solution: bool = Field(True, description="With both a sibling_success and a feedback source in `context`: show the feedback only to rows without a sibling success (SDPO environment_feedback_only_without_solution).")

    provides: ClassVar = ("teacher_logprobs", "judge")
    refs: ClassVar = {"context": TEXT_SOURCES}
    pi: ClassVar[str] = "prior"

    @property
    def is_self(self) -> bool:
        return self.model == "self"

    @model_validator(mode="after")
    def _template_fields(self):
        if self.template is not None:
            names = {f for _, f, _, _ in string.Formatter().parse(self.template) if f}
            unknown = names - {"problem", "prompt", *self.context}
            if unknown:
                raise ValueError(f"template: unknown field(s) {', '.join('{' + n + '}' for n in sorted(unknown))}; "
                                 f"allowed: {{problem}}, {{prompt}} and the context sources "
                                 f"{', '.join('{' + c + '}' for c in self.context) or '(none)'}")
        return self

    # ---- run time ----
    def preflight(self, ctx, name: str) -> None:
        """Before any training: an external model must share the policy's tokenizer (same vocabulary)."""
        if self.is_self:
            return
        from composer.runtime.models import load_tokenizer, resolve, same_vocabulary

        path = resolve(self.model)
        tok = load_tokenizer(path)
        if not same_vocabulary(tok, ctx.tokenizer):
            raise ValueError(
                f"sources.{name}: the tokenizer of '{self.model}' ({path}) differs from the policy's tokenizer "
                f"({getattr(ctx.tokenizer, 'name_or_path', '?')}): {len(tok)} vs {len(ctx.tokenizer)} tokens. "
                "A distillation teacher scores the student's token ids, so both must use one vocabulary; "
                "use a teacher of the same model family or tokenizer.")

    def build(self, ctx, name: str) -> Teacher:
        return Teacher(self, ctx, name)


class Teacher:
    """Runtime of a policy_model source: holds (or points at) the weights and scores rollouts."""

    def __init__(self, cfg: PolicyModel, ctx, name: str):
        import copy

        self.cfg, self.name = cfg, name
        self.net = None  # own weights: external model or EMA copy
        device = next(ctx.policy.parameters()).device
        if not cfg.is_self:
            from composer.runtime.models import load_model, resolve

            cfg.preflight(ctx, name)
            self.net = load_model(resolve(cfg.model), ctx.spec.policy.dtype).eval().requires_grad_(False)
            self.net.to(own_device(device))
        elif cfg.weights == "initial":
            ctx.initial_policy().to(device)
        elif cfg.weights == "ema":  # SDPO: initialised from the initial (reference) weights
            start = ctx._initial if ctx._initial is not None else ctx.policy
            self.net = copy.deepcopy(start).eval().requires_grad_(False).to(device)
        self.sources = {c: ctx.source(c) for c in cfg.context}
        self.kinds = {c: ctx.spec.sources[c].kind for c in cfg.context}

    # ---- weights ----
    def model(self, ctx):
        """The network that scores now."""
        if self.net is not None:
            return self.net
        return ctx.initial_policy() if self.cfg.weights == "initial" else ctx.policy

    def after_optimizer_step(self, ctx) -> None:
        """EMA (SDPO): theta_T <- (1 - rate) theta_T + rate theta on parameters; buffers are copied."""
        if not (self.cfg.is_self and self.cfg.weights == "ema"):
            return
        rate = self.cfg.ema_rate
        with torch.no_grad():
            for t, p in zip(self.net.parameters(), ctx.policy.parameters()):  # tied weights appear once
                t.mul_(1.0 - rate).add_(p.detach().to(t.device, t.dtype), alpha=rate)
            for t, p in zip(self.net.buffers(), ctx.policy.buffers()):
                t.copy_(p)

    def param_distance(self, ctx) -> float | None:
        """L2 distance ||theta_T - theta|| over all parameters (None unless EMA)."""
        if not (self.cfg.is_self and self.cfg.weights == "ema"):
            return None
        with torch.no_grad():
            sq = sum(float(((t - p.to(t.device)) ** 2).sum()) for t, p in
                     zip(self.net.parameters(), ctx.policy.parameters()))
        return sq ** 0.5

    def state_dict(self) -> dict:
        return {"ema": self.net.state_dict()} if self.cfg.is_self and self.cfg.weights == "ema" else {}

    def load_state_dict(self, state: dict) -> None:
        if "ema" in state:
            self.net.load_state_dict(state["ema"])

    # ---- prompts ----
    def context_texts(self, ctx, batch, i: int) -> dict[str, str | None]:
        """{context source name: its text for row i, or None}, with SDPO's rule: feedback only without a sibling."""
        texts = {c: src.text(ctx, batch, i) for c, src in self.sources.items()}
        has_sibling = any(texts[c] is not None for c in texts if self.kinds[c] == "sibling_success")
        if self.cfg.feedback_only_without_solution and has_sibling:
            texts = {c: (None if self.kinds[c] == "feedback" else t) for c, t in texts.items()}
        return texts

    def prompt_text(self, ctx, example, texts: dict[str, str | None]) -> str | None:
        """The teacher prompt for one row; None when the row has no privileged text (use the student's prompt)."""
        present = {c: t for c, t in texts.items() if t is not None}
        if not present:
            return None
        if self.cfg.template is not None:
            return self.cfg.template.format(problem=example.problem, prompt=example.prompt,
                                            **{c: (t or "") for c, t in texts.items()})
        by_kind = {self.kinds[c]: t for c, t in reversed(list(present.items()))}  # first source of a kind wins
        templates = getattr(ctx.task, "templates", None) or {}
        own = [self.kinds[c] for c in present if TEMPLATE_OF[self.kinds[c]] in templates]
        if own:  # the task's own format (toy: one privileged text per prompt, the first in `context` order)
            k = own[0]
            return templates[TEMPLATE_OF[k]].format(problem=example.problem, **{FIELD_OF[k]: by_kind[k]})
        if "reference_solution" in by_kind:  # OPSD
            return OPSD_TEMPLATE.format(problem=example.problem, solution=by_kind["reference_solution"])
        sol = by_kind.get("sibling_success")
        fb = by_kind.get("feedback")
        return SDPO_TEMPLATE.format(prompt=example.prompt, solution=SDPO_SOLUTION.format(text=sol) if sol else "",
                                    feedback=SDPO_FEEDBACK.format(text=fb) if fb else "")

    # ---- scoring ----
    def score(self, ctx, batch, want_logits: bool = False):
        """Teacher log-probs (and logits) on the student's response tokens, in the student's layout.

        Row i of the teacher input is [teacher prompt_i][student response_i] (the same token ids),
        right-padded; one forward pass. Student position t in the response maps to teacher position
        t + (Q_i - P_i), Q_i / P_i the teacher / student prompt lengths.
        Returns teacher_logprobs [B, T], teacher_logits [B, T, V] or None (both 0 off the response,
        logits divided by `temperature`), seq_weight [B] (0 for rows whose context has no text).
        """
        from composer.origins import CODE
        from composer.runtime.models import token_logprobs

        B, T = batch.tokens.shape
        n_prompt = (batch.origin == CODE["prompt"]).sum(1).tolist()  # P_i: prompts come first
        n_tok = batch.attention_mask.sum(1).tolist()  # L_i
        seqs, q_len, weight = [], [], []
        for i in range(B):
            tokens = batch.tokens[i].tolist()
            text = self.prompt_text(ctx, batch.examples[i], self.context_texts(ctx, batch, i)) if self.sources else None
            prompt = ctx.encode(text) if text is not None else tokens[: n_prompt[i]]
            seqs.append(prompt + tokens[n_prompt[i]: n_tok[i]])
            q_len.append(len(prompt))
            weight.append(0.0 if self.sources and text is None else 1.0)
        model = self.model(ctx)
        device = next(model.parameters()).device
        T2 = max(len(s) for s in seqs)
        ids = torch.full((B, T2), ctx.pad_id, dtype=torch.long)  # [B, T2] teacher input, right-padded
        mask = torch.zeros((B, T2), dtype=torch.bool)  # [B, T2]
        for i, s in enumerate(seqs):
            ids[i, : len(s)], mask[i, : len(s)] = torch.tensor(s), True
        with torch.no_grad():
            lp2, logits2, _ = token_logprobs(model, ids.to(device), mask.to(device), self.cfg.temperature, want_logits)
        ctx.costs["teacher_tokens"] = ctx.costs.get("teacher_tokens", 0) + int(mask.sum())
        # re-align: teacher position = student position + (Q_i - P_i), on the student's response tokens
        shift = torch.tensor(q_len) - torch.tensor(n_prompt)  # [B]
        pos = (torch.arange(T)[None, :] + shift[:, None]).clamp(0, T2 - 1).to(device)  # [B, T]
        resp = batch.response_mask.to(device)  # [B, T]
        lp = lp2.gather(1, pos) * resp  # [B, T]
        logits = None
        if want_logits:
            V = logits2.shape[-1]
            logits = logits2.gather(1, pos[..., None].expand(B, T, V)) * resp[..., None]  # [B, T, V]
            logits = logits.to(batch.tokens.device)
        return lp.to(batch.tokens.device), logits, torch.tensor(weight, dtype=torch.float32, device=batch.tokens.device)


def own_device(policy_device):
    """The policy's device, or a spare GPU (one not used by a training rank) when several are present."""
    if policy_device.type != "cuda":
        return policy_device
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    spare = torch.cuda.device_count() - world
    if spare < 1:
        return policy_device
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    return torch.device("cuda", world + rank % spare)
