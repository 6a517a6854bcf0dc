"""Render a Plan for people: text, mermaid, dot."""

from __future__ import annotations

import json


def story(plan: dict) -> list[str]:
    """What will happen, in a few sentences, before the details."""
    out = []
    for seg in plan["segments"]:
        span = f"steps {seg['start']}-{seg['end'] - 1}" if seg["end"] - seg["start"] > 1 else f"step {seg['start']}"
        where = f"stage '{seg['stage']}'" if seg.get("stage") else (f"phase '{seg['name']}'" if seg["name"] != "main" else "")
        head = f"{span}" + (f" ({where})" if where else "")
        trained = sorted({o for t in seg["token_origins"] for o, v in t["origins"].items() if v["loss"]})
        terms = ", ".join(f"{t['objective']} on {t['signal']}" + (f" x{t['weight']:g}" if t["weight"] != 1 else "")
                          for t in seg["token_origins"])
        out.append(f"{head}: {' -> '.join(seg['dataflow'][1:-1] or seg['dataflow'])}; "
                   f"loss {terms} on {', '.join(trained) or 'no'} tokens.")
    return out


def text(plan: dict) -> str:
    lines = [f"{plan['name']}: {plan['summary']}".rstrip(": "), ""]
    lines += ["what will happen:"] + [f"  {s}" for s in story(plan)] + [""]
    lines.append(f"policy: {plan['policy']}   data: {'toy testbed' if plan['testbed'] == 'toy' else plan['data']['train']}"
                 f"   backend: {plan['backend']}   steps: {plan['total_steps']}")
    lines.append(f"rollout engine: {plan['rollout']['engine']}; behaviour log-probs {plan.get('rollout_engine', '')}")
    if plan["sources"]:
        lines += ["", "sources (privileged information: what / when / how it is used):"]
        readers: dict[str, list[str]] = {}
        for e in plan["edges"]:
            if e["from"].startswith("source:"):
                readers.setdefault(e["from"][7:], []).append(f"{e['to']}.{(e['field'] or '').rstrip('_')}")
        for name, s in plan["sources"].items():
            used = ", ".join(s["usage"]) or "unused"
            lines.append(f"  {name:<12} {s['kind']:<18} PI: {s['pi']} ({s['pi_time']}); usage: {used}")
            lines.append(f"  {'':<12} read by: {', '.join(readers.get(name, [])) or 'nothing'}")
    for seg in plan["segments"]:
        stage = f" (stage '{seg['stage']}')" if seg.get("stage") and seg["stage"] != seg["name"] else ""
        lines += ["", f"segment '{seg['name']}'{stage}: steps {seg['start']}-{seg['end']}"]
        lines.append("  dataflow: " + " -> ".join(seg["dataflow"]))
        lines.append("  models:")
        for m in seg["models"]:
            note = f" ({m['note']})" if m.get("note") else ""
            lines.append(f"    {m['role']:<16} {m['model']}{' [trained]' if m['trainable'] else ''}{note}")
        for t in seg["token_origins"]:
            lines.append(f"  {t['term']}: {t['signal']} -> {t['objective']} (weight {t['weight']})")
            for origin, o in t["origins"].items():
                if o["loss"]:
                    anchor = f", anchor: {o['anchor']}" if o["anchor"] else ""
                    lines.append(f"    {origin:<19} loss{anchor}")
                    if o.get("behaviour"):
                        lines.append(f"    {'':<19} behaviour log-probs: {o['behaviour']}")
            masked = [o for o, v in t["origins"].items() if v.get("present", True) and not v["loss"]]
            lines.append(f"    no loss: {', '.join(masked) or '-'}")
    return "\n".join(lines)


def mermaid(plan: dict) -> str:
    lines = ["graph LR"]
    ids = {}

    def nid(name):
        return ids.setdefault(name, f"n{len(ids)}")

    for e in plan["edges"]:
        label = f"|{e['field'].rstrip('_')}|" if e["field"] else ""
        lines.append(f"  {nid(e['from'])}[\"{e['from']}\"] -->{label} {nid(e['to'])}[\"{e['to']}\"]")
    return "\n".join(lines)


def dot(plan: dict) -> str:
    lines = [f"digraph \"{plan['name']}\" {{", "  rankdir=LR;"]
    for e in plan["edges"]:
        label = f" [label=\"{e['field'].rstrip('_')}\"]" if e["field"] else ""
        lines.append(f"  \"{e['from']}\" -> \"{e['to']}\"{label};")
    lines.append("}")
    return "\n".join(lines)


def as_json(plan: dict) -> str:
    return json.dumps(plan, indent=2, default=str)
