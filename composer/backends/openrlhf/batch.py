"""OpenRLHF Experience fields <-> the composer's TrajectoryBatch, and the label side channel.

Layouts. OpenRLHF (0.11.2) right-pads single-sample experiences into `sequences` [B, T]; per-action
tensors (`action_mask`, `rollout_log_probs`, `action_log_probs`, `base_action_log_probs`) are [B, T-1]
and entry j is about token j+1. The composer's per-token tensors are [B, T] with entry t about token t
and 0 at t = 0 (composer/batch.py). So composer = shift(openrlhf) and openrlhf = unshift(composer).

Provenance. OpenRLHF keeps only per-sample scalars (`extra_logs` -> Experience.info) and the `label`
string from a rollout. The composer's label is JSON: the example's answer/solution/problem, the step
(set when prompts are dispatched), and after a guided rollout the token origins as spans
[[start, end, origin], ...] in sequence coordinates, the control/guided flags and a group tag.
"""

from __future__ import annotations

import json
from typing import Any

from composer.batch import TrajectoryBatch
from composer.data import Example
from composer.lazy import torch
from composer.origins import CODE

# ---------------------------------------------------------------------------------------------- labels

def encode_label(meta: dict) -> str:
    return json.dumps(meta, separators=(",", ":"))


def decode_label(label: Any) -> dict:
    """The composer label as a dict; a plain string label is an answer."""
    if isinstance(label, dict):
        return dict(label)
    if isinstance(label, str) and label.startswith("{"):
        try:
            out = json.loads(label)
            if isinstance(out, dict):
                return out
        except json.JSONDecodeError:
            pass
    return {"answer": "" if label is None else str(label)}


def next_draw(counts: dict, prompt: str, label) -> int:
    """How many samples of (prompt, label) this engine started before this one (OpenRLHF starts a prompt's
    samples in order; the label holds the trainer step), counted in `counts`."""
    key = (prompt, str(label))
    draw = counts.get(key, 0)
    counts[key] = draw + 1
    if len(counts) > 100_000:
        counts.clear()
    return draw


def request_seeds(*key):
    """The vLLM `SamplingParams.seed` of each request of one rollout: a counter over the requests made for `key`
    (the run's seed, the global step, the prompt, the sample's draw number, ...), each seed a hash of (key,
    k). vLLM samples a request with a seed from its own generator, so what a rollout samples depends on the
    step and its place in the step only, not on what the engine served before: a job resumed from a checkpoint
    samples what an uninterrupted one did (OpenRLHF's checkpoint holds no sampler state)."""
    import hashlib

    count = iter(range(1 << 62))

    def seed() -> int:
        blob = json.dumps([*key, next(count)], separators=(",", ":"), default=str).encode()
        return int.from_bytes(hashlib.sha256(blob).digest()[:4], "big") & 0x7FFFFFFF

    return seed


def example_of(prompt: str, meta: dict) -> Example:
    return Example(prompt=prompt, answer=str(meta.get("answer", "")), solution=meta.get("solution"),
                   problem=meta.get("problem") or "", tier=meta.get("tier"), meta=dict(meta.get("meta") or {}))


def label_of(example: Example, **extra) -> dict:
    """The JSON label of a data row (what the bundle writes into data/*.jsonl)."""
    meta = {"answer": example.answer, "solution": example.solution, "problem": example.problem}
    if example.tier is not None:
        meta["tier"] = example.tier
    if example.meta:
        meta["meta"] = {k: v for k, v in example.meta.items() if isinstance(v, (str, int, float, bool, type(None)))}
    meta.update(extra)
    return meta


def group_ids(prompts: list[str], metas: list[dict]) -> torch.Tensor:
    """[B] advantage groups: one per (prompt, guide tag); guided prompts (POPE) form their own group."""
    keys: dict = {}
    return torch.tensor([keys.setdefault((p, m.get("tag", "")), len(keys)) for p, m in zip(prompts, metas)],
                        dtype=torch.long)


# ---------------------------------------------------------------------------------------------- layout

def shift(x: torch.Tensor) -> torch.Tensor:
    """OpenRLHF action layout [B, T-1, ...] -> composer token layout [B, T, ...] (0 at t = 0)."""
    return torch.cat([x.new_zeros((x.shape[0], 1) + tuple(x.shape[2:])), x], dim=1)


def unshift(x: torch.Tensor) -> torch.Tensor:
    """Composer token layout [B, T, ...] -> OpenRLHF action layout [B, T-1, ...]."""
    return x[:, 1:]


def origins(attention_mask, action_mask, metas: list[dict], trainable_only: bool = False) -> torch.Tensor:
    """[B, T] uint8 origin codes: pad, prompt before the first response token, policy for action tokens,
    and whatever the label's spans say (guide_prefix / guide_intervention / policy).

    trainable_only: tokens outside the action mask count as prompt (the loss view: OpenRLHF computes the
    current log-probs of action tokens only, so nothing else may get loss), and a row at weight 0 (the
    agent keeps one action token in it, since OpenRLHF divides by the token count) has none at all."""
    att = attention_mask.bool()
    act = shift(action_mask.bool())  # [B, T]
    B, T = att.shape
    out = torch.full((B, T), CODE["prompt"], dtype=torch.uint8, device=att.device)
    out[act] = CODE["policy"]
    for i, meta in enumerate(metas):
        for start, end, origin in meta.get("spans") or []:
            out[i, max(0, start):min(T, end)] = CODE[origin]
    if trainable_only:
        out[~act] = CODE["prompt"]
        for i, meta in enumerate(metas):  # nothing to train (the agent's one placeholder token): no loss token
            if meta.get("weight") == 0:
                out[i][act[i]] = CODE["pad"]
    out[~att] = CODE["pad"]
    return out


def to_batch(sequences, attention_mask, action_mask, prompts: list[str], labels: list, *, rollout_log_probs=None,
             rewards=None, base_log_probs=None, group=None, info: dict | None = None,
             trainable_only: bool = False) -> TrajectoryBatch:
    """A TrajectoryBatch from Experience fields (any subset of rows; tensors on one device).

    sequences/attention_mask [B, T], action_mask [B, T-1], rollout_log_probs / base_log_probs [B, T-1]
    (behaviour log-probs from vLLM / the reference slot's log-probs), rewards [B], group [B] (default: one
    group per row; the advantage step passes the real groups).
    """
    metas = [decode_label(x) for x in labels]
    B = sequences.shape[0]
    dev = sequences.device
    beh = shift(rollout_log_probs.float()) if rollout_log_probs is not None else torch.zeros(sequences.shape, device=dev)
    weights = [m.get("weight") for m in metas]
    return TrajectoryBatch(
        tokens=sequences.long(),
        origin=origins(attention_mask, action_mask, metas, trainable_only),
        behavior_logprobs=beh,
        group=group.to(dev) if group is not None else torch.arange(B, device=dev),
        control=torch.tensor([bool(m.get("control", True)) for m in metas], device=dev),
        guided=torch.tensor([bool(m.get("guided", False)) for m in metas], device=dev),
        rewards=None if rewards is None else rewards.reshape(-1).float().to(dev),
        teacher_logprobs=None if base_log_probs is None else shift(base_log_probs.float()),
        seq_weight=None if all(w is None for w in weights) else torch.tensor(
            [1.0 if w is None else float(w) for w in weights], device=dev),
        examples=[example_of(p, m) for p, m in zip(prompts, metas)],
        info=dict(info or {}),
    )


def from_batch(batch: TrajectoryBatch, trainable: tuple = ("policy",)) -> dict:
    """Experience fields of a TrajectoryBatch: action_mask marks the `trainable` origins (OpenRLHF's loss
    and log-prob mask), labels carry every non-policy origin as spans."""
    labels = []
    for i in range(batch.size):
        meta = {"answer": batch.examples[i].answer} if batch.examples else {}
        meta["spans"] = spans_of(batch.origin[i].tolist())
        meta["control"] = bool(batch.control[i])
        if batch.guided is not None:
            meta["guided"] = bool(batch.guided[i])
        labels.append(encode_label(meta))
    return {
        "sequences": batch.tokens,
        "attention_mask": batch.attention_mask.long(),
        "action_mask": unshift(batch.mask(trainable) & batch.attention_mask),
        "rollout_log_probs": unshift(batch.behavior_logprobs),
        "rewards": batch.rewards,
        "labels": labels,
    }


def spans_of(codes: list[int]) -> list[list]:
    """Runs of non-prompt, non-pad origins as [start, end, origin] (end exclusive)."""
    out, start = [], None
    for t, c in enumerate(codes + [CODE["pad"]]):
        if start is not None and c != codes[start]:
            out.append([start, t, _NAME[codes[start]]])
            start = None
        if start is None and t < len(codes) and c not in (CODE["pad"], CODE["prompt"]):
            start = t
    return out


_NAME = {v: k for k, v in CODE.items()}


def action_ranges(spans: list[list], trainable) -> list[tuple[int, int]]:
    """OpenRLHF `action_ranges` (the tokens that get loss and log-probs) from origin spans."""
    return [(s, e) for s, e, o in spans if o in trainable and e > s]
