"""A learned reward model as a reward source: a sequence-classification checkpoint scoring prompt + response.

As OpenRLHF's reward model (openrlhf/models/model.py get_llm_for_sequence_regression, `_get_reward_model`) and TRL's
`get_reward`: a transformers *ForSequenceClassification with one output (head `score`) over the whole sequence; the
score is read at the last non-padding token (ALGORITHMS.md section 14). Its tokenizer and chat template may differ
from the policy's, so by default the text is re-tokenised:
  input text    the policy's user message and the decoded response, rendered with the reward model's chat template
                (user turn, assistant turn) when it has one, else the policy's prompt text followed by the response
                text; tokenised by the reward model's tokenizer (its own special tokens, if its template adds none)
  input tokens  the rollout's own token ids (prompt and response, as the policy wrote them): the reward model must
                share the policy's vocabulary (checked before training); what OpenRLHF's reward model reads
Normalisation: none; config (r - mean) / std with the mean and std the checkpoint's config.json holds (OpenRLHF
--reward.normalize_enable); running: (r - mean) / std over every score this source gave so far in the run (the
batch's included; Welford, kept in checkpoints).
"""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field

from composer.contract import Runtime, Source
from composer.lazy import torch
from composer.registry import register


@register("sources")
class RewardModel(Source):
    """A learned reward model: a sequence-classification checkpoint scoring prompt + response (score at the last token)."""

    kind: Literal["reward_model"] = Field("reward_model", description="Component kind.")
    model: str = Field(..., description="The reward model: a transformers *ForSequenceClassification checkpoint with one output (id, directory, or `toy:reward`, the toy testbed's, trained to predict its verifier).")
    input: Literal["text", "tokens"] = Field("text", description="text: re-tokenise the policy's user message and the response with the reward model's own tokenizer and chat template (any tokenizer); tokens: score the rollout's token ids as they are (the policy's vocabulary; what OpenRLHF's reward model reads).")
    normalize: Literal["none", "config", "running"] = Field("none", description="none; config: (r - mean) / std with the checkpoint's config.json `mean` and `std` (OpenRLHF --reward.normalize_enable); running: by the running mean and std of every score this source gave so far in the run (Lightning only).")
    batch_size: int = Field(64, ge=1, le=1 << 16, description="Sequences per reward-model forward pass.")
    trust_remote_code: bool = Field(False, description="Allow the checkpoint's own Python code to run when it loads (off: such a model is refused).")

    provides: ClassVar = ("sequence_reward",)
    pi: ClassVar[str] = "posterior"
    scored_by_model: ClassVar[bool] = True

    @property
    def model_path(self) -> str | None:
        return self.model

    def describe(self) -> str:
        how = {"text": "re-tokenised text (its own tokenizer and chat template)",
               "tokens": "the rollout's token ids"}[self.input]
        norm = {"none": "", "config": ", normalised by its config's mean and std",
                "running": ", normalised by the running mean and std"}[self.normalize]
        return f"reward model {self.model} on {how}, score at the last token{norm}"

    def preflight(self, ctx, name: str) -> None:
        """Before any training: the checkpoint's tokenizer loads, and with `input: tokens` has the policy's vocabulary."""
        from composer.errors import ModelLoadError

        tok = ctx.load_tokenizer(ctx.resolve_model(self.model), trust_remote_code=self.trust_remote_code)
        if self.input == "tokens" and tok.get_vocab() != ctx.tokenizer.get_vocab():
            raise ModelLoadError(f"sources.{name}: input: tokens scores the policy's token ids, and the tokenizer of "
                                 f"'{self.model}' differs from the policy's ({len(tok)} vs {len(ctx.tokenizer)} tokens); "
                                 "use input: text (re-tokenised)")

    def build(self, ctx, name: str) -> "RewardModelScorer":
        return RewardModelScorer(self, ctx, name)


class RewardModelScorer(Runtime):
    """A reward_model source in a run: the network (frozen), its tokenizer, the running statistics."""

    def __init__(self, cfg: RewardModel, ctx, name: str):
        self.cfg, self.name = cfg, name
        path = ctx.resolve_model(cfg.model)
        self.tokenizer = ctx.load_tokenizer(path, trust_remote_code=cfg.trust_remote_code)
        self.net = ctx.load_scorer(path, ctx.spec.policy.dtype, cfg.trust_remote_code).eval().requires_grad_(False)
        self.net = self.net.to(next(ctx.policy.parameters()).device)
        self.count, self.mean, self.m2 = 0, 0.0, 0.0  # Welford's running moments of the raw scores

    # ---- inputs ----
    def inputs(self, ctx, batch) -> list[list[int]]:
        """Each row's token ids as the reward model reads them (see the module docstring)."""
        if self.cfg.input == "tokens":
            mask = batch.attention_mask
            return [batch.tokens[i][mask[i]].tolist() for i in range(batch.size)]
        return [self.tokenizer.encode(t, add_special_tokens=not has_template(self.tokenizer))
                for t in self.texts(ctx, batch)]

    def texts(self, ctx, batch) -> list[str]:
        """Each row's text for the reward model (`input: text`)."""
        from composer.trajectory import response_texts

        responses = batch.info.get("texts") or response_texts(batch, ctx.tokenizer)
        fmt = ctx.prompt_format()
        out = []
        for ex, resp in zip(batch.examples, responses):
            out.append(render(self.tokenizer, fmt.user(ex), resp, fmt.system) if has_template(self.tokenizer)
                       else ex.prompt + resp)
        return out

    # ---- scores ----
    def raw_scores(self, ctx, batch):
        """[B] the head's output at each row's last token (float32)."""
        ids = self.inputs(ctx, batch)
        device = next(self.net.parameters()).device
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        out = []
        for s in range(0, len(ids), self.cfg.batch_size):
            chunk = ids[s: s + self.cfg.batch_size]
            T = max(len(x) for x in chunk)
            tok = torch.full((len(chunk), T), pad, dtype=torch.long)
            mask = torch.zeros((len(chunk), T), dtype=torch.bool)
            for i, x in enumerate(chunk):
                tok[i, : len(x)] = torch.tensor(x, dtype=torch.long)
                mask[i, : len(x)] = True
            with torch.no_grad():
                scores = ctx.token_scores(self.net, tok.to(device), mask.to(device)).float().cpu()  # [b, T]
            last = mask.long().sum(1) - 1  # [b]: the last non-padding position (right padding)
            out.append(scores.gather(1, last[:, None]).squeeze(1))
        ctx.costs["reward_model_tokens"] = ctx.costs.get("reward_model_tokens", 0) + sum(len(x) for x in ids)
        return torch.cat(out) if out else torch.zeros(0)

    def rewards(self, ctx, batch):
        """[B] the reward of each row: the score, normalised as declared (`normalize`)."""
        r = self.raw_scores(ctx, batch)
        ctx.log(**{f"reward_model/{self.name}_raw": float(r.mean())})
        if self.cfg.normalize == "config":
            c = self.net.config
            r = (r - float(getattr(c, "mean", 0.0))) / float(getattr(c, "std", 1.0))
        elif self.cfg.normalize == "running":
            for x in r.double().tolist():  # Welford: the batch's own scores count
                self.count += 1
                d = x - self.mean
                self.mean += d / self.count
                self.m2 += d * (x - self.mean)
            std = (self.m2 / self.count) ** 0.5 if self.count > 1 else 1.0
            r = (r - self.mean) / max(std, 1e-8)
        return r.float()

    def state_dict(self) -> dict:
        return {"count": self.count, "mean": self.mean, "m2": self.m2}

    def load_state_dict(self, state: dict) -> None:
        self.count, self.mean, self.m2 = int(state["count"]), float(state["mean"]), float(state["m2"])


def has_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def render(tokenizer, user: str, response: str, system: str | None = None) -> str:
    """The reward model's chat template over (system,) user, assistant turns, under the composer's time and size
    limits (composer/template_limits.py): no generation prompt, the response as the assistant's message."""
    from composer.template_limits import render as limited

    messages = ([{"role": "system", "content": system}] if system is not None else []) + \
        [{"role": "user", "content": user}, {"role": "assistant", "content": response}]
    return limited(tokenizer, messages, {}, add_generation_prompt=False)
