"""Assembling trajectory batches from finished traces (composer/protocol.py) with provenance."""

from __future__ import annotations

import torch

from composer.batch import TrajectoryBatch
from composer.data import Example
from composer.origins import CODE
from composer.protocol import Trace


def assemble(traces: list[Trace], examples: list[Example], prompt_index: list[int], pad_id: int) -> TrajectoryBatch:
    """Pad traces into a TrajectoryBatch.

    Advantage groups: one per (prompt, trace tag), numbered in order of appearance. Behaviour log-probs
    come from the pieces; a piece without them (guide tokens nobody scored) holds 0 and is marked
    unknown in `behavior_known`.
    """
    B = len(traces)
    T = max((len(t.tokens) for t in traces), default=1)
    tokens = torch.full((B, T), pad_id, dtype=torch.long)
    origin = torch.zeros((B, T), dtype=torch.uint8)
    lp = torch.zeros((B, T), dtype=torch.float32)
    known = torch.zeros((B, T), dtype=torch.bool)
    groups: dict[tuple, int] = {}
    group = []
    for i, (tr, p) in enumerate(zip(traces, prompt_index)):
        n = len(tr.prompt)
        tokens[i, :n] = torch.tensor(tr.prompt, dtype=torch.long)
        origin[i, :n] = CODE["prompt"]
        pos = n
        for piece in tr.pieces:
            m = len(piece.tokens)
            tokens[i, pos: pos + m] = torch.tensor(piece.tokens, dtype=torch.long)
            origin[i, pos: pos + m] = CODE[piece.origin]
            if piece.logprobs is not None:
                lp[i, pos: pos + m] = torch.tensor(piece.logprobs, dtype=torch.float32)
                known[i, pos: pos + m] = True
            pos += m
        group.append(groups.setdefault((p, tr.tag), len(groups)))
    weights = [tr.weight for tr in traces]
    return TrajectoryBatch(
        tokens=tokens, origin=origin, behavior_logprobs=lp, behavior_known=known,
        group=torch.tensor(group, dtype=torch.long),
        control=torch.tensor([tr.control for tr in traces], dtype=torch.bool),
        guided=torch.tensor([tr.guided for tr in traces], dtype=torch.bool),
        prompt_index=torch.tensor(prompt_index, dtype=torch.long),
        examples=list(examples),
        seq_weight=None if all(w is None for w in weights) else torch.tensor(
            [1.0 if w is None else float(w) for w in weights], dtype=torch.float32),
        notes=[tr.notes for tr in traces],
    )


def response_texts(batch: TrajectoryBatch, tokenizer) -> list[str]:
    """Decoded response (every non-prompt, non-pad token) of each row, without special tokens; in an episode
    (rollout.environment) its final answer: the tokens after the last environment turn the policy answered
    (composer/episodes.py `answer_span`), which is what a verifier reads."""
    from composer.episodes import answer_span
    from composer.origins import ORIGINS

    mask = batch.response_mask
    env = batch.mask(("environment",)).any(-1).tolist()
    out = []
    for i in range(batch.size):
        ids = batch.tokens[i][mask[i]].tolist()
        if env[i]:
            s, e = answer_span([ORIGINS[c] for c in batch.origin[i][mask[i]].tolist()])
            ids = ids[s:e]
        out.append(tokenizer.decode(ids, skip_special_tokens=True))
    return out
