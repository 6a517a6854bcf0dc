"""Loud warnings for a segment whose verifier read nothing or whose reward never varied (a GRPO run then
learns nothing, while every step looks normal: reward 0, unparsed_frac 1.0)."""

from __future__ import annotations

import logging

log = logging.getLogger("composer")


class RewardWatch:
    """Counts, per segment, the verifier's verdicts of the steps this process trained."""

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
