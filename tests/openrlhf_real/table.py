"""The closing table of issue 42: each shipped spec as a real OpenRLHF job, from the rows the real-job tiers wrote.

    COMPOSER_REAL_TABLE=rows.jsonl pytest -m cluster tests/test_openrlhf_real.py
    COMPOSER_REAL_TABLE=rows.jsonl pytest -m "cluster and slow" tests/test_openrlhf_every_spec.py
    python tests/openrlhf_real/table.py rows.jsonl          # a Markdown table on stdout

Per spec under specs/: how the backend takes it as shipped (compiled here for the smallest layout, as the slower
tier does: accepted, or refused with the setting and the reason), then one line per job the tiers ran of it:
starts (the job ran to its end) / trains (runs that moved the weights, of the runs) / steps trained of declared
/ OpenRLHF's logged policy_loss is the loss it trained on / every step's loss equals the Lightning backend's on the
same batch and weights (within the tier's tolerance; the largest |difference|). A spec with no job row says so.
"""

from __future__ import annotations

import json
import re
import sys
import tempfile
from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(TESTS))

from test_openrlhf_every_spec import SPECS, refusal

# the settings every short job changes (steps, batch, temperature; per stage, phase ends): the table names the rest
SHORT = re.compile(r"^(stages\[\d+\]\.)?(train\.steps|train\.prompts_per_step|rollout\.samples_per_prompt"
                   r"|rollout\.temperature)=|^phases\[\d+\]\.until=")


def yes(ok, detail: str = "") -> str:
    word = "—" if ok is None else ("yes" if ok else "**NO**")
    return f"{word} ({detail})" if detail else word


def job_cells(r: dict) -> list[str]:
    """starts / trains / steps / logged loss / loss = Lightning / seconds of one job row."""
    worst = "—" if r["worst"] is None else f"{r['worst']:.2g}"
    steps = f"{r['steps_trained']} / {r['steps_declared']}"
    return [yes(r["succeeded"] or r["steps_trained"] > 0, "" if r["succeeded"] else "the job failed"),
            yes(r["runs"] > 0 and r["runs_moved"] == r["runs"], f"{r['runs_moved']} of {r['runs']} runs"),
            steps if r["steps_trained"] == r["steps_declared"] else f"**{steps}**",
            yes(r["logged_is_trained"]),
            yes(r["within_tol"] and r["worst"] is not None, worst),
            "—" if r["seconds"] is None else f"{r['seconds']:.0f}"]


def table(rows: list[dict]) -> str:
    out = [("| spec | as shipped | job (test; settings besides the short job's) | starts | trains (weights moved) "
            "| steps trained / declared | logged loss = trained | loss = Lightning (largest diff) | job s |"),
           "|---|---|---|---|---|---|---|---|---|"]
    for spec in SPECS:
        with tempfile.TemporaryDirectory() as tmp:
            e = refusal(spec, [], Path(tmp))
        shipped = "compiles" if e is None else f"refused at compile: `{'.'.join(map(str, e.path))}`: {e.reason}"
        jobs = [r for r in rows if r["spec"] == spec]
        if not jobs:
            out.append(f"| `{spec}` | {shipped} | {'**no job ran**' if e is None else '—'} |" + " |" * 6)
        for i, r in enumerate(jobs):
            other = " ".join(o for o in r["overrides"] if not SHORT.match(o))
            name = r["test"].split("::")[-1].split("[")[0]
            name = ("every-spec tier" if name == "test_spec_runs_as_a_real_job" else name) + (f"; `{other}`" if other else "")
            out.append(f"| `{spec}` | {shipped if i == 0 else '〃'} | {name} | " + " | ".join(job_cells(r)) + " |")
    return "\n".join(out)


def main() -> None:
    rows = [json.loads(x) for f in sys.argv[1:] for x in Path(f).read_text().splitlines() if x.strip()]
    print(table(rows))


if __name__ == "__main__":
    main()
