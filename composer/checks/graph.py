"""Layer 3: the spec as a networkx graph of components, and the checks that read it."""

from __future__ import annotations

from dataclasses import dataclass

import networkx as nx

from composer.errors import Diagnostic, did_you_mean


@dataclass
class Slot:
    """One component placed in the spec: its node name, its path, and its config."""

    node: str
    path: tuple
    component: object


def slots(spec) -> list[Slot]:
    """Every component of a (resolved) spec, with where it stands."""
    out = [Slot(f"source:{n}", ("sources", n), s) for n, s in spec.sources.items()]
    out.append(Slot("guide", ("rollout", "guide"), spec.rollout.guide))
    for i, (sig, obj) in enumerate(signal_objective_pairs(spec)):
        base = ("terms", i) if spec.terms else ()
        tag = f"[{i}]" if spec.terms else ""
        if sig is not None:
            out.append(Slot(f"signal{tag}", base + ("signal",), sig))
        if obj is not None:
            out.append(Slot(f"objective{tag}", base + ("objective",), obj))
    return out


def signal_objective_pairs(spec) -> list[tuple]:
    if spec.terms:
        return [(t.signal, t.objective) for t in spec.terms]
    return [(spec.signal, spec.objective)]


def _field_key(component, field: str) -> str:
    f = type(component).model_fields.get(field)
    return (f.alias or field) if f is not None else field


def build(spec) -> tuple[nx.DiGraph, list[Diagnostic]]:
    """Nodes for policy, rollout, sources, guide, signals, objectives, sync; edges for every reference and flow.

    Returns the graph and the diagnostics about references (unknown names, wrong kinds).
    """
    g = nx.DiGraph()
    diags: list[Diagnostic] = []
    g.add_node("policy", kind="policy")
    g.add_node("rollout", kind="rollout")
    g.add_node("sync", kind="sync")
    g.add_edge("policy", "rollout", flow=True)
    g.add_edge("sync", "rollout", flow=True)
    placed = slots(spec)
    for s in placed:
        g.add_node(s.node, kind=s.component.kind_name(), section=s.component.section, path=s.path)
    g.add_edge("guide", "rollout", flow=True)
    for s in placed:
        if s.node.startswith("signal"):
            g.add_edge("rollout", s.node, flow=True)
            g.add_edge(s.node, s.node.replace("signal", "objective"), flow=True)
        for field, names in s.component.ref_names().items():
            allowed = type(s.component).refs.get(field, ())
            many = isinstance(getattr(s.component, field), list)
            for j, name in enumerate(names):
                path = s.path + (_field_key(s.component, field),) + ((j,) if many else ())
                if name == "self" and s.node.startswith("source:"):
                    continue
                target = spec.sources.get(name)
                if target is None:
                    diags.append(Diagnostic("graph", f"no source named '{name}'", path, None,
                                            did_you_mean(name, spec.sources) or "declare it under `sources:`"))
                    continue
                if allowed and target.kind_name() not in allowed:
                    diags.append(Diagnostic(
                        "graph", f"'{name}' is {_a(target.kind_name())} source; {field.rstrip('_')} must be "
                        f"{' or '.join(allowed)}", path, None, _wrong_kind_hint(spec, field.rstrip('_'), allowed)))
                    continue
                g.add_edge(f"source:{name}", s.node, field=field, path=path)
    return g, diags


def check(spec) -> tuple[nx.DiGraph, list[Diagnostic]]:
    """Reference, port and cycle checks of one resolved spec (unused sources are checked across segments)."""
    g, diags = build(spec)
    if diags:
        return g, diags
    # needs that nothing provides: a component's needs must come from the sources it refers to
    for node, attrs in g.nodes(data=True):
        if not node.startswith("source:") and attrs.get("section") != "signal":
            continue
        comp = _component(spec, node)
        provided = set()
        for pred in g.predecessors(node):
            if pred.startswith("source:"):
                provided |= set(_component(spec, pred).provides)
        missing = [n for n in comp.needs if n not in provided]
        if missing:
            diags.append(Diagnostic("graph", f"{comp.kind_name()} needs {', '.join(missing)}, which nothing it "
                                    f"refers to provides", attrs["path"], None,
                                    "refer it to a source that provides " + ", ".join(missing)))
    sources_only = g.subgraph([n for n in g if n.startswith("source:")])
    try:
        cycle = nx.find_cycle(sources_only)
    except nx.NetworkXNoCycle:
        cycle = None
    if cycle:
        names = " -> ".join(e[0].split(":", 1)[1] for e in cycle) + " -> " + cycle[0][0].split(":", 1)[1]
        first = cycle[0][1]
        diags.append(Diagnostic("graph", f"sources refer to each other in a cycle: {names}",
                                g.nodes[first]["path"], None, "break the cycle: a source cannot depend on itself"))
    return g, diags


def used_sources(g: nx.DiGraph) -> set[str]:
    return {n.split(":", 1)[1] for n in g if n.startswith("source:") and g.out_degree(n) > 0}


def _component(spec, node: str):
    if node.startswith("source:"):
        return spec.sources[node.split(":", 1)[1]]
    if node == "guide":
        return spec.rollout.guide
    pairs = signal_objective_pairs(spec)
    i = int(node[node.index("[") + 1: -1]) if "[" in node else 0
    return pairs[i][0] if node.startswith("signal") else pairs[i][1]


def _wrong_kind_hint(spec, field: str, allowed) -> str:
    ok = [n for n, s in spec.sources.items() if s.kind_name() in allowed]
    if ok:
        return f"point {field} at " + (f"'{ok[0]}'" if len(ok) == 1 else "one of " + ", ".join(f"'{n}'" for n in ok))
    return f"declare {_a(' or '.join(allowed))} source under `sources:` and name it here"


def _a(word: str) -> str:
    return ("an " if word[:1] in "aeiou" else "a ") + word
