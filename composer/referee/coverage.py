"""What `composer check` covered (DESIGN.md section 10, issue 52): every part the spec declares, the references in
its own file that check it, and whether the short run exercised it. `composer check SPEC --coverage` prints it.

A part is
  covered       when its kind declares a reference (`reference_loss`, `reference_advantages`, `reference`,
                `reference_control`, ...: methods whose name starts with `reference`, defined by a registered kind,
                not a base's default); "none in its file" otherwise (the referee may still check it from the
                recorded run: a verifier's verdicts, a teacher's log-probs; that is said in the check table);
  exercised     when the run gave its reference something to tell apart: a loss recomputed, a bound that changed a
                token's loss, an aggregation over rows of different lengths, control rows checked. "not exercised"
                is never a pass: the line says what would make the part act.
"""

from __future__ import annotations

from pydantic import BaseModel

HINTS = {  # why a part the run did not exercise stayed idle, and what makes it act
    "bound": "the ratio stayed inside the bound (bound none: inside the clip's range) on every token (one "
             "on-policy update per step keeps it at 1): train.epochs=2 or a larger train.lr moves it",
    "pairs": "no group held two rows of different rewards, so no pair formed: data tiers where the groups are mixed "
             "(e.g. data.train_tiers=[6]) or more samples per prompt",
    "aggregation": "every row had the same number of loss tokens, so the aggregations agree: more varied prompts",
    "token_selection": "no token was selected on a batch that held its whole step",
    "off_policy_weight": "no loss token the policy did not write",
    "correction": "the sampler's log-probs equalled the trainer's on every token (w = 1 to 1e-3): the sampler in "
                  "float32 with the trainer's weights; rollout.precision: bf16 or the vLLM engine makes them differ",
}


def declared_parts(model, path: str = "") -> list[tuple[str, object]]:
    """(field path, component) of every component inside `model` (a spec or a component), depth first."""
    out = []
    for name in type(model).model_fields:
        out += _walk(getattr(model, name), f"{path}.{name}" if path else name)
    return out


def _walk(value, path: str) -> list[tuple[str, object]]:
    from composer.registry import Component

    if isinstance(value, Component):
        return [(path, value)] + declared_parts(value, path)
    if isinstance(value, BaseModel):
        return declared_parts(value, path)
    if isinstance(value, dict):
        return [p for k, v in value.items() for p in _walk(v, f"{path}.{k}")]
    if isinstance(value, (list, tuple)):
        return [p for i, v in enumerate(value) for p in _walk(v, f"{path}[{i}]")]
    return []


def references(part) -> list[str]:
    """The reference methods the part's kind declares (defined by a registered kind or its registered parent, never a
    base class's default)."""
    out = []
    for name in sorted(dir(type(part))):
        if not name.startswith("reference") or not callable(getattr(type(part), name, None)):
            continue
        owner = next((c for c in type(part).__mro__ if name in c.__dict__), None)
        if owner is not None and "kind" in owner.__dict__.get("__annotations__", {}):
            out.append(name)
    return out


def rows(v, rep) -> list[dict]:
    """One row per declared part of every segment: path, kind, references, exercised (text), idle (bool)."""
    from composer.checks.terms import terms

    out, seen = [], set()
    for seg in v.segments:
        term_of = {id(o): n for n, _s, o, _w in terms(seg.spec) if o is not None}
        objective_at = {}
        for path, part in declared_parts(seg.spec):
            key = (seg.name if len(v.segments) > 1 else "", path, part.kind_name())
            if key in seen:
                continue
            seen.add(key)
            where = f"{seg.name}: {path}" if len(v.segments) > 1 else path
            row = {"path": where, "kind": part.kind_name(), "references": references(part), "exercised": "",
                   "idle": False}
            if id(part) in term_of:  # an objective: its losses recomputed, and the fields that act per token
                term = term_of[id(part)]
                objective_at[path] = term
                n = rep.checked.get(term, 0)
                row["exercised"], row["idle"] = (f"{n} losses recomputed", False) if n else ("not exercised: no loss "
                                                                                               "recomputed", True)
                out.append(row)
                for field in ("bound", "aggregation", "pairs"):
                    value = getattr(part, field, None) or getattr(part, "loss_agg" if field == "aggregation" else "", None)
                    if value is not None and (term, field) in rep.acted:
                        why = getattr(part, "idle_reason", lambda spec, f: None)(seg.spec, field)
                        out.append(_acted(f"{where}.{field}", str(value), term, field, rep, why)
                                   | {"references": [f"{part.kind_name()}.reference_loss"]})
                continue
            if not getattr(type(part), "acts", True):  # a setting that does nothing (kind none)
                out.append(row | {"exercised": "does nothing", "references": ["-"]})
                continue
            parent, _, field = path.rpartition(".")
            if parent in objective_at and (objective_at[parent], field) in rep.acted and getattr(type(part), "acts", True):
                acted = _acted(where, part.kind_name(), objective_at[parent], field, rep)
                row.update(exercised=acted["exercised"], idle=acted["idle"])
            elif hasattr(part, "reference_control") and "reference_control" in row["references"]:
                c = rep.checks.get("control rows as declared")
                row["exercised"] = f"control rows of {c.passed} rollouts checked" if c and c.passed else ""
            elif "reference_replies" in row["references"]:  # an environment: its answers replayed
                c = rep.checks.get("environment answers as declared")
                n = c.passed + c.failed if c else 0
                row["exercised"], row["idle"] = (f"{n} environment answers replayed", False) if n else (
                    "not exercised: the environment never answered (no tool call in the short run: a policy that "
                    "calls its tools, e.g. toy:tools on data.toy_task: tools)", True)
            elif "reference_verdicts" in row["references"]:
                c = rep.checks.get("verdicts re-verified")
                row["exercised"] = f"{c.passed + c.failed} verdicts re-verified" if c and c.passed + c.failed else ""
            out.append(row)
    return out


def _acted(path: str, kind: str, term: str, field: str, rep, why: str | None = None) -> dict:
    n = rep.acted.get((term, field), 0)
    if n:
        what = {"aggregation": "batches with rows of different lengths", "pairs": "pairs"}.get(field, "tokens")
        return {"path": path, "kind": kind, "references": [], "exercised": f"acted: {n} {what}", "idle": False}
    if why:  # the part cannot act in a run of this spec at all (validate warns of it): nothing to exercise
        return {"path": path, "kind": kind, "references": [], "exercised": f"cannot act in this run: {why}",
                "idle": False}
    return {"path": path, "kind": kind, "references": [], "exercised": f"not exercised: {HINTS.get(field, '')}",
            "idle": True}


def table(v, rep) -> str:
    """The coverage table `composer check --coverage` prints."""
    rs = rows(v, rep)
    w = max([len(r["path"]) for r in rs] + [4])
    k = max([len(r["kind"]) for r in rs] + [4])
    out = [f"coverage: {rep.spec}", f"  {'part'.ljust(w)}  {'kind'.ljust(k)}  reference in its file / exercised"]
    for r in rs:
        ref = ", ".join(r["references"]) or ("-" if r["exercised"] else "none in its file")
        out.append(f"  {r['path'].ljust(w)}  {r['kind'].ljust(k)}  {ref}" + (f"; {r['exercised']}" if r["exercised"] else ""))
    idle = [r["path"] for r in rs if r["idle"]]
    out.append(f"{len(rs)} parts, {sum(1 for r in rs if r['references'])} with a reference in their file, "
               f"{len(idle)} not exercised" + (f" ({', '.join(idle)})" if idle else ""))
    return "\n".join(out)
