"""Assembling trajectory batches from per-row pieces with provenance."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from composer.batch import TrajectoryBatch, pad_and_stack
from composer.data import Example
from composer.origins import CODE


@dataclass
class Row:
    """One trajectory before padding: the prompt and the response as pieces, each with its origin."""

    example: Example
    prompt: list[int]
    pieces: list[tuple[list[int], str]] = field(default_factory=list)  # (token ids, origin name)
    group: int = 0
    prompt_index: int = 0
    control: bool = True
    guided: bool = False

    @property
    def response(self) -> list[int]:
        return [t for ids, _ in self.pieces for t in ids]

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.response

    def origins(self) -> list[int]:
        out = [CODE["prompt"]] * len(self.prompt)
        for ids, origin in self.pieces:
            out += [CODE[origin]] * len(ids)
        return out


def assemble(rows: list[Row], pad_id: int, logprobs: list[list[float]] | None = None) -> TrajectoryBatch:
    """Pad rows into a TrajectoryBatch; `logprobs` are the rollout weights' per-token log-probs."""
    seqs = [r.tokens for r in rows]
    lps = logprobs if logprobs is not None else [[0.0] * len(s) for s in seqs]
    tokens, origin, lp = pad_and_stack(seqs, [r.origins() for r in rows], lps, pad_id)
    return TrajectoryBatch(
        tokens=tokens, origin=origin, behavior_logprobs=lp,
        group=torch.tensor([r.group for r in rows], dtype=torch.long),
        control=torch.tensor([r.control for r in rows], dtype=torch.bool),
        guided=torch.tensor([r.guided for r in rows], dtype=torch.bool),
        prompt_index=torch.tensor([r.prompt_index for r in rows], dtype=torch.long),
        examples=[r.example for r in rows],
    )


def response_texts(batch: TrajectoryBatch, tokenizer) -> list[str]:
    """Decoded response (every non-prompt, non-pad token) of each row, without special tokens."""
    mask = batch.response_mask
    return [tokenizer.decode(batch.tokens[i][mask[i]].tolist(), skip_special_tokens=True) for i in range(batch.size)]
