"""Loud warnings for a segment whose verifier read nothing or whose reward never varied (a GRPO run then
learns nothing, while every step looks normal: reward 0, unparsed_frac 1.0)."""

from __future__ import annotations

import logging

log = logging.getLogger("composer")


class RewardWatch:
    """Counts, per segment, the verifier's verdicts of the steps this process trained; under DDP each rank holds
    its own rows' verdicts, and `gathered` joins them before anything is said (issue 56: rank 0's rows alone
    gave "the reward was 0.0 for every step" while the other rank's rows had rewards of 1)."""

    def __init__(self):
        self.seen: dict[str, dict] = {}

    def note(self, segment: str, batches) -> None:
        """The verdicts the step's batches hold (outcome rewards keep them in batch.info["verdicts"])."""
        verdicts = [v for b in batches for v in ((getattr(b, "info", None) or {}).get("verdicts") or [])]
        if not verdicts:
            return
        s = self.seen.setdefault(segment, {"steps": 0, "rollouts": 0, "parsed": 0, "rewards": set()})
        s["steps"] += 1
        s["rollouts"] += len(verdicts)
        s["parsed"] += sum(bool(getattr(v, "parsed", True)) for v in verdicts)
        s["rewards"].update(float(v.reward) for v in verdicts)

    def merge(self, seen: dict) -> None:
        """Add another rank's counts (its `seen`): the steps are the same steps on every rank, the rollouts,
        parsed answers and rewards add up."""
        for name, other in seen.items():
            s = self.seen.setdefault(name, {"steps": 0, "rollouts": 0, "parsed": 0, "rewards": set()})
            s["steps"] = max(s["steps"], other["steps"])
            s["rollouts"] += other["rollouts"]
            s["parsed"] += other["parsed"]
            s["rewards"] |= set(other["rewards"])

    def gathered(self) -> RewardWatch:
        """Every rank's counts in one watch (torch.distributed's all_gather_object: every rank must call it);
        this watch itself with one process."""
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() <= 1:
            return self
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, self.seen)
        out = RewardWatch()
        for seen in every:
            out.merge(seen)
        return out

    def problems(self) -> list[str]:
        """One line per segment whose verifier parsed nothing, or whose reward was the same for every rollout."""
        out = []
        for name, s in self.seen.items():
            where = f"segment {name!r}" if name else "the run"
            counts = f"{s['steps']} step(s), {s['rollouts']} rollouts"
            if s["parsed"] == 0:
                out.append(f"{where}: the verifier parsed no final answer in any of {counts} (unparsed_frac 1.0 "
                           "throughout): every reward was 0 and nothing was learned from it.\n    hint: look at "
                           "samples.jsonl (`composer samples RUN`) for what the model writes; the math verifier "
                           "reads \\boxed{}, GSM8K's `#### 46`, a `#46` line or \"The answer is 46\"; SFT first on "
                           "answers in one of these forms, or ask for one in data.system_prompt")
            elif len(s["rewards"]) == 1:
                out.append(f"{where}: the reward was {next(iter(s['rewards']))} for every one of {counts} "
                           f"({s['parsed']} parsed): group-relative advantages were all 0, nothing was learned from "
                           "the reward.\n    hint: check the verifier against samples.jsonl (`composer samples "
                           "RUN`); a task too hard or too easy for the policy gives no signal")
        return out

    def warn(self) -> list[str]:
        found = self.problems()
        for line in found:
            log.warning(f"WARNING: {line}")
        return found
