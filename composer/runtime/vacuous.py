"""A segment that trained on nothing (issue 40 part 2): counted from what each step logged, said at its end.

Per segment (the run, a phase, a stage) a `Tally` counts, over its steps:
  - each gated term's steps whose gate selected no row (`gate_frac` / `<term>/gate_frac` = 0),
  - the steps whose rollout filter kept nothing: no prompt with mixed rewards (`filter/kept_frac` = 0, with
    equal_groups: drop) or every response cut and masked / dropped (`filter/truncated_frac` = 1, with truncated:
    mask or drop),
  - the steps whose verifier parsed no response (`unparsed_frac` = 1),
and whether the trainable weights moved between the segment's start and end (`fingerprint`).
A count equal to the segment's steps is a finding: that part of the method never acted. `composer run` prints
the findings as a warning when the segment ends and, with `--strict`, stops the run there with an error (the
checkpoint of that step is kept). The referee (`composer check`) can call `findings_from_rows` on the rows of
metrics.csv and compare weights itself.

Only the metric names above are read, so the counting needs neither torch nor the run; `fingerprint` imports
torch when it is called.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


def _gated(spec) -> list[tuple[str, str]]:
    """(term name, the metric its gate logs) of each gated term of a segment (composer/gates.py gate_metrics)."""
    from composer.checks.terms import gates, terms

    names = [n for n, _s, _o, _w in terms(spec)]
    return [(n, f"{n}/gate_frac") for n, g in zip(names, gates(spec)) if g is not None]


def _verifies(spec) -> bool:
    return any(s.kind_name() == "outcome_reward" for s in spec.sources.values())


@dataclass
class Tally:
    """What one segment's steps did: counts of steps where a part selected / kept / parsed nothing."""

    segment: str
    start: int
    end: int
    steps: int = 0
    gate_empty: dict = field(default_factory=dict)  # term -> steps its gate selected no row
    gate_seen: dict = field(default_factory=dict)  # term -> steps its gate was logged
    kept_nothing: int = 0  # equal_groups: drop kept no prompt
    kept_seen: int = 0
    all_cut: int = 0  # truncated: mask/drop and every response was cut
    cut_seen: int = 0
    unparsed_all: int = 0  # the verifier parsed no response
    unparsed_seen: int = 0
    moved: bool | None = None  # the trainable weights changed over the segment (None: not compared)

    def add(self, spec, row: dict) -> None:
        """One step's logged metrics (a metrics.csv row: missing or empty cells are not counted)."""
        self.steps += 1
        for name, key in _gated(spec):
            v = _num(row.get(key))
            if v is not None:
                self.gate_seen[name] = self.gate_seen.get(name, 0) + 1
                self.gate_empty[name] = self.gate_empty.get(name, 0) + (v <= 0)
        flt = spec.rollout.filter
        v = _num(row.get("filter/kept_frac"))
        if flt.equal_groups == "drop" and v is not None:
            self.kept_seen += 1
            self.kept_nothing += v <= 0
        v = _num(row.get("filter/truncated_frac"))
        if flt.truncated != "keep" and v is not None:
            self.cut_seen += 1
            self.all_cut += v >= 1
        v = _num(row.get("unparsed_frac"))
        if _verifies(spec) and v is not None:
            self.unparsed_seen += 1
            self.unparsed_all += v >= 1

    def findings(self) -> list[str]:
        """Each part that never acted over the whole segment, with its counts."""
        n, out = self.steps, []
        if n == 0:
            return out
        for name, empty in self.gate_empty.items():
            if empty == self.gate_seen.get(name) == n:
                out.append(f"term '{name}': its gate selected no row in {empty} of {n} steps (gate_frac 0): the "
                           "term never trained")
        if self.kept_seen == n and self.kept_nothing == n:
            out.append(f"rollout.filter kept no prompt in {n} of {n} steps (filter/kept_frac 0: every group's "
                       "rewards were equal); the steps were filled with dropped prompts")
        if self.cut_seen == n and self.all_cut == n:
            out.append(f"rollout.filter: every response was cut at max_new_tokens in {n} of {n} steps "
                       "(filter/truncated_frac 1), so no row got loss")
        if self.unparsed_seen == n and self.unparsed_all == n:
            out.append(f"the verifier parsed no response in {n} of {n} steps (unparsed_frac 1): every reward is "
                       "the unparsed one")
        if self.moved is False:
            out.append(f"the policy's trainable weights did not move over the segment's {n} step(s)")
        return out

    def report(self) -> str:
        """The loud warning (or --strict error) text; empty when every part acted."""
        found = self.findings()
        if not found:
            return ""
        what = "the run" if self.segment == "main" else f"segment '{self.segment}'"
        lines = [f"{what} (steps {self.start}-{self.end - 1}) trained on nothing in {len(found)} way(s):"]
        lines += [f"  - {f}" for f in found]
        return "\n".join(lines)

    def state(self) -> dict:
        return asdict(self)

    @classmethod
    def from_state(cls, state: dict) -> "Tally":
        return cls(**state)


def _num(v) -> float | None:
    if v is None or v == "":
        return None
    try:
        x = float(v)
    except (TypeError, ValueError):
        return None
    return x if x == x else None


def findings_from_rows(spec, rows, segment: str = "main", start: int = 0, end: int | None = None,
                       moved: bool | None = None) -> list[str]:
    """The findings of one segment from its steps' metric rows (metrics.csv, dicts of name -> value), for a
    caller that has the rows rather than the live run (the referee). `moved`: whether the weights moved, when
    the caller compared them."""
    rows = list(rows)
    t = Tally(segment, start, start + len(rows) if end is None else end)
    for r in rows:
        t.add(spec, r)
    t.moved = moved
    return t.findings()


def fingerprint(model) -> list[float]:
    """A cheap summary of the trainable weights (per tensor: the float64 sum and sum of squares): equal summaries
    before and after a segment mean its optimizer steps changed nothing."""
    from composer.lazy import torch

    out = []
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                x = p.detach().double()
                out += [float(x.sum()), float((x * x).sum())]
    return out
