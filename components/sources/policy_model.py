"""A policy model as a source: an external teacher or judge, or the policy itself with privileged context.

As a teacher it scores the student's own rollouts and never generates: for each row it builds a
teacher prompt (the problem plus the privileged texts of its `context` sources, every one placed, as the
user message of the policy's prompt format: chat template and system prompt, composer/prompts.py),
tokenizes it once, appends exactly the student's response token ids, and takes
log pi_T(y_t | teacher prompt, y_<t) in one forward pass (`score_responses`, which both backends call
with their own forward function).
  - OPD (Lu / Thinking Machines 2025): an external teacher, no context, the student's own prompt.
  - OPSD (Zhao et al. 2026, arXiv 2601.18734): `model: self` shown the reference solution.
  - SDPO (Hübotter et al. 2026, arXiv 2601.20802): `model: self` (EMA weights) shown a successful
    sibling, else the verifier's feedback; rows with neither get s_i = 0.
As a judge it reviews steps (components/guides/judges.py) with the same weights.
"""

from __future__ import annotations

import string
from typing import ClassVar, Literal

from pydantic import Field, field_validator

from composer.contract import Runtime, Source
from composer.lazy import F, torch
from composer.registry import register

TEXT_SOURCES = ("reference_solution", "feedback", "sibling_success")


@register("sources")
class PolicyModel(Source):
    """A language model that scores (teacher) or reviews (judge) the policy's rollouts; never generates rollouts itself."""

    kind: Literal["policy_model"] = Field("policy_model", description="Component kind.")
    model: str = Field(..., description="Model id or directory, `self` (the trained policy's network), or `toy:teacher` / `toy:student` (the toy testbed's checkpoints).")
    weights: Literal["current", "initial", "ema"] = Field("current", description="With `model: self`: the live weights, the frozen reference weights (the policy at the start of the stage, see train.reference), or an exponential moving average.")
    ema_rate: float = Field(0.05, gt=0, le=1, description="EMA update rate: theta_T <- (1 - rate) theta_T + rate theta after every optimiser step (SDPO: 0.05).")
    context: list[str] = Field(default_factory=list, description="Textual sources shown to this model in its prompt (reference_solution, feedback, sibling_success); every one is placed, or the run stops before training.")
    template: str | None = Field(None, description="Prompt template. As a teacher: {problem} (or {prompt}) and one {<source name>} per context source. As a judge (verdict prompt): also {accepted} and {steps}. Default: the task's templates, else the OPSD/SDPO templates.")
    shares_tokenizer: bool = Field(True, description="Declares that this model uses the policy's tokenizer (distillation needs it; checked for real when models load).")
    temperature: float = Field(1.0, gt=0, description="Logits are divided by this before scoring (OPSD: the sampling temperature).")
    feedback_only_without_solution: bool = Field(True, description="With both a sibling_success and a feedback source in `context`: show the feedback only to rows without a sibling success (SDPO environment_feedback_only_without_solution).")
    trust_remote_code: bool = Field(False, description="Allow an external model directory's own Python code to run when it loads (off: such a model is refused).")

    provides: ClassVar = ("teacher_logprobs", "judge")
    refs: ClassVar = {"context": TEXT_SOURCES}
    pi: ClassVar[str] = "prior"

    @property
    def is_self(self) -> bool:
        return self.model == "self"

    @property
    def wants_initial(self) -> bool:
        return self.is_self and self.weights == "initial"

    @property
    def model_path(self) -> str | None:
        return self.model

    @field_validator("template")
    @classmethod
    def _template_syntax(cls, template):
        """Only plain {name} fields: a format spec ({x:>999999999}) or an attribute ({x.__class__}) could
        allocate gigabytes or reach into objects when the prompt is rendered."""
        if template is not None:
            for _lit, name, spec, conv in string.Formatter().parse(template):
                if name is None:
                    continue
                if not name.isidentifier() or spec or conv:
                    raise ValueError(f"'{{{name}{'!' + conv if conv else ''}{':' + spec if spec else ''}}}' is not a "
                                     "plain field; write {name} (no format specs, conversions or indexing); a "
                                     "literal brace is written {{ or }}")
        return template

    def template_fields(self) -> set[str]:
        """The {fields} of `template` (empty without one)."""
        if self.template is None:
            return set()
        return {name for _l, name, _s, _c in string.Formatter().parse(self.template) if name}

    # ---- run time ----
    def preflight(self, ctx, name: str) -> None:
        """Before any training: an external model must share the policy's tokenizer (same vocabulary)."""
        if self.is_self or not self.shares_tokenizer:
            return
        from composer.errors import ModelLoadError

        path = ctx.resolve_model(self.model)
        tok = ctx.load_tokenizer(path, trust_remote_code=self.trust_remote_code)
        if tok.get_vocab() != ctx.tokenizer.get_vocab():  # the input's fault: a message and exit 2, not an internal error
            raise ModelLoadError(
                f"sources.{name}: the tokenizer of '{self.model}' ({path}) differs from the policy's tokenizer "
                f"({getattr(ctx.tokenizer, 'name_or_path', '?')}): {len(tok)} vs {len(ctx.tokenizer)} tokens. "
                "A distillation teacher scores the student's token ids, so both must use one vocabulary; "
                "use a teacher of the same model family or tokenizer.")

    def teacher_prompts(self, ctx, name: str, batch) -> list:
        """(prompt ids or None, weight) per row of `batch`: see `teacher_prompts` below (both backends)."""
        return teacher_prompts(ctx, self, {c: ctx.spec.sources[c].kind for c in self.context}, name, batch)

    def score_tokens(self, forward_logits, tokens, attention_mask, prompt_len: list[int], prompts: list,
                     pad_id: int, want_logits: bool):
        """Teacher log-probs (and logits) at this source's temperature: `score_responses` (both backends)."""
        return score_responses(forward_logits, tokens, attention_mask, prompt_len, prompts, self.temperature, pad_id,
                               want_logits)

    def build(self, ctx, name: str) -> "ModelSource":
        return ModelSource(self, ctx, name)


class ModelSource(Runtime):
    """Runtime of a policy_model source: holds (or points at) the weights; serves judge requests and
    scores rollouts as a teacher."""

    def __init__(self, cfg: PolicyModel, ctx, name: str):
        import copy

        self.cfg, self.name = cfg, name
        self.net = None  # own weights: external model or EMA copy
        self.tokenizer = ctx.tokenizer
        self._server = None
        device = next(ctx.policy.parameters()).device
        if not cfg.is_self:
            cfg.preflight(ctx, name)
            path = ctx.resolve_model(cfg.model)
            self.net = ctx.load_model(path, ctx.spec.policy.dtype, trust_remote_code=cfg.trust_remote_code)
            self.net = self.net.eval().requires_grad_(False).to(own_device(device))
            if not cfg.shares_tokenizer:
                self.tokenizer = ctx.load_tokenizer(path, trust_remote_code=cfg.trust_remote_code)
        elif cfg.weights == "initial":
            ctx.initial_policy().to(device)
        elif cfg.weights == "ema":  # SDPO: initialised from the initial (reference) weights
            start = ctx.models.initial if ctx.models.initial is not None else ctx.policy
            self.net = copy.deepcopy(start).eval().requires_grad_(False).to(device)
        self.kinds = {c: ctx.spec.sources[c].kind for c in cfg.context}

    # ---- weights ----
    def model(self, ctx):
        """The network that scores now."""
        if self.net is not None:
            return self.net
        return ctx.initial_policy() if self.cfg.weights == "initial" else ctx.policy

    def server(self, ctx):
        """What answers this source's generation requests (a judge): its own weights, or for `self` the
        rollout engine (current) / the frozen initial policy (initial)."""
        if self.cfg.is_self and self.cfg.weights == "current":
            return ctx.engine
        if self.cfg.is_self and self.cfg.weights == "initial":
            return ctx.model_server("initial")
        if self._server is None:
            self._server = ctx.serve(self.model(ctx), self.tokenizer)
        return self._server

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

    # ---- teacher prompts ----
    def context_texts(self, ctx, batch, i: int) -> dict[str, str | None]:
        """{context source name: its text for row i, or None}, with SDPO's rule: feedback only without a sibling."""
        return context_texts(ctx, self.cfg, self.kinds, batch, i)

    def render(self, ctx, example):
        """The teacher prompt of one problem as a function of its context texts."""
        from composer.prompts import Render, teacher_prompt, which_template

        fmt = ctx.prompt_format()  # rendered as the policy's prompts are (the teacher scores the policy's ids)
        return Render(lambda texts: teacher_prompt(ctx.task, self.cfg, self.kinds, example, texts, fmt),
                      list(self.cfg.context), which_template(ctx.task, self.cfg, "teacher", self.kinds))

    def prompts(self, ctx, batch) -> list[tuple[list[int] | None, float]]:
        """(teacher prompt token ids, or None for the student's own prompt; row weight) per row: weight 0 for
        a row whose declared context has no text (SDPO: no sibling success and no feedback)."""
        return teacher_prompts(ctx, self.cfg, self.kinds, self.name, batch)

    def score(self, ctx, batch, want_logits: bool = False):
        """Teacher log-probs [B, T] (and logits [B, T, V] or None) on the student's response tokens, and the
        row weights [B] (see `prompts`)."""
        from composer.origins import CODE

        prompts = self.prompts(ctx, batch) if self.cfg.context else [(None, 1.0)] * batch.size
        model = self.model(ctx)
        device = next(model.parameters()).device

        def forward(ids, mask):
            return model(input_ids=ids.to(device), attention_mask=mask.to(device)).logits

        n_prompt = (batch.origin == CODE["prompt"]).sum(1).tolist()
        lp, logits = self.cfg.score_tokens(forward, batch.tokens, batch.attention_mask, n_prompt,
                                           [p for p, _ in prompts], ctx.pad_id, want_logits)
        ctx.costs["teacher_tokens"] += sum(len(p) if p is not None else n for (p, _), n in zip(prompts, n_prompt)) \
            + int(batch.response_mask.sum())
        w = torch.tensor([w for _, w in prompts], dtype=torch.float32, device=batch.tokens.device)
        return lp.to(batch.tokens.device), None if logits is None else logits.to(batch.tokens.device), w


def context_texts(ctx, cfg: PolicyModel, kinds: dict[str, str], batch, i: int) -> dict[str, str | None]:
    """Row i's privileged texts per context source; SDPO's rule: no feedback where a sibling succeeded."""
    texts = {c: ctx.source(c).text(ctx, batch, i) for c in cfg.context}
    has_sibling = any(texts[c] is not None for c in texts if kinds[c] == "sibling_success")
    if cfg.feedback_only_without_solution and has_sibling:
        texts = {c: (None if kinds[c] == "feedback" else t) for c, t in texts.items()}
    return texts


def teacher_prompts(ctx, cfg: PolicyModel, kinds: dict[str, str], name: str, batch):
    """(prompt ids or None, weight) per row of `batch` for a teacher with context (see ModelSource.prompts);
    each prompt is recorded with the texts it was built from."""
    from composer.prompts import teacher_prompt

    out, fmt = [], ctx.prompt_format()  # the policy's prompt format: chat template, system prompt
    for i in range(batch.size):
        texts = context_texts(ctx, cfg, kinds, batch, i)
        text = teacher_prompt(ctx.task, cfg, kinds, batch.examples[i], texts, fmt)
        if text is not None:
            ctx.record("prompt", source=name, usage="teacher", text=text, context=texts)
        out.append((None, 0.0) if text is None else (ctx.encode(text), 1.0))
    return out


def score_responses(forward_logits, tokens, attention_mask, prompt_len: list[int], prompts: list, temperature: float,
                    pad_id: int, want_logits: bool):
    """Teacher log-probs (and logits) of each row's response under its own prompt; both backends call this.

    Row i of the teacher input is [prompts[i] (or the row's own prompt when None)][response_i], the
    response being tokens[i, prompt_len[i]:L_i] exactly; `forward_logits(ids [B, T2], mask [B, T2]) ->
    [B, T2, V]` gives raw next-token logits. Student position t maps to teacher position t + Q_i - P_i
    (Q_i, P_i: teacher / student prompt lengths). Returns lp [B, T] and logits [B, T, V] or None, 0 off the
    response, logits divided by `temperature`.
    """
    B, T = tokens.shape
    n_tok = attention_mask.long().sum(1).tolist()
    seqs, q_len = [], []
    for i in range(B):
        row = tokens[i].tolist()
        prompt = list(prompts[i]) if prompts[i] is not None else row[: prompt_len[i]]
        seqs.append(prompt + row[prompt_len[i]: n_tok[i]])
        q_len.append(len(prompt))
    T2 = max(len(s) for s in seqs)
    ids = torch.full((B, T2), pad_id, dtype=torch.long, device=tokens.device)
    mask = torch.zeros((B, T2), dtype=torch.long, device=tokens.device)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s, device=tokens.device)
        mask[i, : len(s)] = 1
    with torch.no_grad():
        raw = forward_logits(ids, mask).float().to(tokens.device) / temperature  # [B, T2, V]: j predicts j + 1
    logits2 = torch.cat([raw.new_zeros(B, 1, raw.shape[-1]), raw[:, :-1]], dim=1)  # [B, T2, V]: t predicts t
    lp2 = F.log_softmax(logits2, -1).gather(-1, ids[..., None]).squeeze(-1)  # [B, T2]
    lp2[:, 0] = 0.0
    off = torch.tensor(q_len, device=tokens.device) - torch.tensor(prompt_len, device=tokens.device)  # [B]
    pos = (torch.arange(T, device=tokens.device)[None, :] + off[:, None]).clamp(0, T2 - 1)  # [B, T]
    resp = torch.zeros((B, T), dtype=torch.bool, device=tokens.device)
    for i in range(B):
        resp[i, prompt_len[i]: n_tok[i]] = True
    lp = lp2.gather(1, pos) * resp  # [B, T]
    logits = None
    if want_logits:
        V = logits2.shape[-1]
        logits = logits2.gather(1, pos[..., None].expand(B, T, V)) * resp[..., None]  # [B, T, V]
    return lp, logits


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
