"""Render a Plan for people: text, mermaid, dot."""

from __future__ import annotations

import json

from composer.errors import printable  # every renderer's output: spec-provided text never reaches the terminal raw


def story(plan: dict) -> list[str]:
    """What will happen, in a few sentences per segment, before the details: who writes which tokens,
    which tokens get which loss, and what loads."""
    out = []
    for seg in plan["segments"]:
        span = f"steps {seg['start']}-{seg['end'] - 1}" if seg["end"] - seg["start"] > 1 else f"step {seg['start']}"
        where = f"stage '{seg['stage']}'" if seg.get("stage") else (f"phase '{seg['name']}'" if seg["name"] != "main" else "")
        out.append(f"{span}" + (f" ({where})" if where else "") + ":")
        out += [f"  writes: {w}" for w in seg.get("writers", [])]
        for t in seg["token_origins"]:
            trained = [o for o, v in t["origins"].items() if v["loss"]]
            weight = f" (weight {t.get('weight_text', t['weight'])})" if t["weight"] != 1 else ""
            out.append(f"  learns: {t['objective']} on the {t['signal']} signal{weight}, on "
                       f"{', '.join(trained) or 'no'} tokens")
            if t.get("gate"):
                out.append(f"    gate: {t['term']} trains only on rows where {t['gate']}; other rows get no loss "
                           "from it and do not count in its normaliser")
        out.append("  loads: " + ", ".join(_load(m) for m in seg["models"]))
    return out


def _load(m: dict) -> str:
    if m["role"] == "policy":
        return f"the policy {m['model']} (trained)"
    if m["role"] == "rollout":
        return "its rollout copy"
    role = m["role"].split(":", 1)[-1]
    if m["role"].startswith("critic:"):
        return f"{role}'s critic ({'a head on the policy' if m['model'] == 'self' else m['model']}, trained)"
    return f"'{role}' ({m['model']})" if m["role"].startswith("source:") else f"the {role} policy (frozen)"


def data_lines(plan: dict) -> list[str]:
    """Which file and split a run trains and evaluates on (plan["data_files"], what this machine found:
    composer/runtime/example_prompts.py `machine_notes`), and how it evaluates."""
    d, found = plan.get("data") or {}, plan.get("data_files") or {}
    if plan.get("testbed") == "toy" or not found.get("train"):
        return []
    lines = [f"train data: {found['train']}"]
    for role, line in (plan.get("data_format") or {}).items():  # messages rows (composer/conversations.py)
        lines.append(f"{role} data format: {line}")
    t = plan.get("train") or {}
    if found.get("eval"):
        k = t.get("eval_k") or 0
        how = f"greedy pass@1 on the first {t.get('eval_samples', '?')} rows" + (f", pass@k for k up to {k}" if k > 1 else "")
        lines.append(f"eval data: {found['eval']}; {how}"
                     + (f", verifier {t['eval_verifier']}" if t.get("eval_verifier") else ", the reward's verifier"))
    else:
        lines.append("eval data: none (data.eval or data.eval_split): no evaluation")
    return lines


def text(plan: dict) -> str:
    lines = [f"{plan['name']}: {plan['summary']}".rstrip(": "), ""]
    lines += ["what will happen:"] + [f"  {s}" for s in story(plan)] + [""]
    lines.append(f"policy: {plan['policy']}   data: {'toy testbed' if plan['testbed'] == 'toy' else plan['data']['train']}"
                 f"   backend: {plan['backend']}   steps: {plan['total_steps']}")
    lines.append(f"rollout engine: {plan['rollout']['engine']}; behaviour log-probs {plan.get('rollout_engine', '')}")
    if plan.get("stop_tokens"):  # composer/stops.py: a response ends at the first of them
        lines.append(f"stop tokens: {plan['stop_tokens']}")
    lines += data_lines(plan)
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
    lines += prompt_lines(plan)
    for seg in plan["segments"]:
        stage = f" (stage '{seg['stage']}')" if seg.get("stage") and seg["stage"] != seg["name"] else ""
        lines += ["", f"segment '{seg['name']}'{stage}: steps {seg['start']}-{seg['end']}"]
        lines.append("  dataflow: " + " -> ".join(seg["dataflow"]))
        lines.append("  models:")
        for m in seg["models"]:
            note = f" ({m['note']})" if m.get("note") else ""
            lines.append(f"    {m['role']:<16} {m['model']}{' [trained]' if m['trainable'] else ''}{note}")
        for t in seg["token_origins"]:
            lines.append(f"  {t['term']}: {t['signal']} -> {t['objective']} (weight {t.get('weight_text', t['weight'])})")
            lines += [f"    {s}" for s in t.get("settings", [])]
            if t.get("gate"):
                lines.append(f"    gate: only rows where {t['gate']}")
            for origin, o in t["origins"].items():
                if o["loss"]:
                    anchor = f", anchor: {o['anchor']}" if o["anchor"] else ""
                    lines.append(f"    {origin:<19} loss{anchor}")
                    if o.get("behaviour"):
                        lines.append(f"    {'':<19} behaviour log-probs: {o['behaviour']}")
            masked = [o for o, v in t["origins"].items() if v.get("present", True) and not v["loss"]]
            lines.append(f"    no loss: {', '.join(masked) or '-'}")
    if plan.get("schedule"):  # what both backends execute, step by step (composer/plan/schedule.py)
        from composer.plan.schedule import lines as schedule_lines

        lines += schedule_lines(plan)
    return printable("\n".join(lines))


def prompt_lines(plan: dict) -> list[str]:
    """One rendered example prompt: the policy's, each teacher's and each judge's (plan["prompts"]), every line
    behind a bar so that leading spaces and the newline after a generation prompt show."""
    p = plan.get("prompts")
    if not p:
        return []
    if "error" in p:
        return ["", f"prompts: not rendered here: {p['error']}"]
    lines = ["", f"prompts ({p['describe']}):", f"  the policy's, for {p['example']}:"] + _block(p["policy"])
    for name, e in p["sources"].items():
        ctx = f"; context: {', '.join(e['context'])}" if e.get("context") else ""
        if "error" in e:
            lines.append(f"  '{name}': not rendered here: {e['error']}")
        if "teacher" in e:
            lines += [f"  teacher '{name}' ({e['teacher_note']}{ctx}):"] + _block(e["teacher"])
        if "judge" in e:
            lines += [(f"  judge '{name}', its verdict prompt ({e['judge_note']}{ctx}; steps of the reference as "
                       "the steps under review):")] + _block(e["judge"])
    return lines


def _block(text: str, max_lines: int = 30, width: int = 160) -> list[str]:
    rows = text.split("\n")
    out = [("    | " + (r if len(r) <= width else r[:width] + " ...")) if r else "    |" for r in rows[:max_lines]]
    if len(rows) > max_lines:
        out.append(f"    | ... ({len(rows) - max_lines} more lines)")
    return out


def _groups(plan: dict) -> list[tuple[str | None, list[dict]]]:
    """(segment label, its edges): one group per segment when the spec has phases or stages, else the graph."""
    segs = plan["segments"]
    if len(segs) <= 1:
        return [(None, plan["edges"])]
    return [(f"{'stage' if s.get('stage') else 'phase'} {s.get('stage') or s['name']}: steps {s['start']}-{s['end'] - 1}",
             s["edges"]) for s in segs]


def mermaid(plan: dict) -> str:
    """Mermaid flowchart; a phased or staged spec draws each segment's graph in a subgraph of its own."""
    lines = ["graph LR"]
    ids = {}

    def nid(k, name):
        return ids.setdefault((k, name), f"n{len(ids)}")

    for k, (label, edges) in enumerate(_groups(plan)):
        pad = "  "
        if label:
            lines.append(f"  subgraph s{k}[\"{label}\"]")
            pad = "    "
        for e in edges:
            arrow = f"|{e['field'].rstrip('_')}|" if e["field"] else ""
            lines.append(f"{pad}{nid(k, e['from'])}[\"{e['from']}\"] -->{arrow} {nid(k, e['to'])}[\"{e['to']}\"]")
        if label:
            lines.append("  end")
    return printable("\n".join(lines))


def dot(plan: dict) -> str:
    """Graphviz; a phased or staged spec draws each segment as a cluster."""
    lines = [f"digraph \"{plan['name']}\" {{", "  rankdir=LR;"]
    for k, (label, edges) in enumerate(_groups(plan)):
        pad, pre = "  ", ""
        if label:
            lines += [f"  subgraph cluster_{k} {{", f"    label=\"{label}\";"]
            pad, pre = "    ", f"s{k}:"
            names = {n for e in edges for n in (e["from"], e["to"])}
            lines += [f"{pad}\"{pre}{n}\" [label=\"{n}\"];" for n in sorted(names)]
        for e in edges:
            attr = f" [label=\"{e['field'].rstrip('_')}\"]" if e["field"] else ""
            lines.append(f"{pad}\"{pre}{e['from']}\" -> \"{pre}{e['to']}\"{attr};")
        if label:
            lines.append("  }")
    lines.append("}")
    return printable("\n".join(lines))


def as_json(plan: dict) -> str:
    return json.dumps(plan, indent=2, default=str)
