"""What a part of a spec can run with: one record per component (and spec section), declared next to it.

    Capabilities(on_policy_only=True, exact_origins=frozenset(), needs=())

  on_policy_only  it assumes rollouts from the current weights, with no correction: a lagged sampler
                  (sync.every > 1) is refused unless sync.off_policy_ok (checks/rules.py `lag_needs_correction`).
                  The default is the safe one: a component that says nothing is on-policy only.
  exact_origins   token origins it trains on exactly, with no importance ratio to a behaviour log-prob (an exact
                  divergence over the vocabulary): tokens the policy did not write are fine there. Default: none.
  needs           the features of a backend its configuration relies on (FEATURES), each with the field that asks
                  for it. A backend declares the features it lacks with the reason (the OpenRLHF bundle:
                  composer/backends/openrlhf/flags.py `LACKS`); `compile` refuses a spec whose parts need one, naming
                  the field. Default: none (it runs wherever the contract runs).

A component overrides `capabilities()` (composer/registry.py `Component`), a spec section (policy, rollout.filter,
sync, train) too (composer/lang/spec.py); `parts(spec)` walks every part of a resolved spec with its path. What each
backend can run is derived from these records, never listed by hand. Nothing here imports torch.
"""

from __future__ import annotations

from dataclasses import dataclass

FEATURES = {
    "sequences_not_sampled": "trains on sequences the step's sampler did not draw (a dataset's, another model's)",
    "step_token_mask": "a per-token mask computed over the whole step's tokens, read by every micro-batch's loss",
    "rollout_reuse": "trains several steps on the rollouts sampled after one sync (sync.reuse)",
    "capped_refill": "a cap on the extra sampling rounds of a filter that drops prompts",
    "row_drop": "removes rows from a step before its advantages",
    "separate_tokenizer": "a tokenizer loaded from elsewhere than the model",
    "periodic_reset": "replaces the reference weights and the optimizer state inside a run",
    "sampled_eval": "evaluation by pass@k over sampled answers",
    "scheduled_entropy": "an entropy bonus whose coefficient follows a schedule",
    "coupled_rows": "a loss that couples the rows of a group (a pair term): every micro-batch and rank holds whole groups",
    "episodes": "rollouts of several policy turns with an environment's answers between them (rollout.environment)",
}


@dataclass(frozen=True)
class Need:
    """A feature of a backend that a part's configuration relies on; `field` is the path below the part that asks for
    it (its spec field, where a refusal points)."""

    feature: str
    field: tuple = ()

    def __post_init__(self):
        if self.feature not in FEATURES:
            raise ValueError(f"unknown backend feature {self.feature!r}; known: {', '.join(FEATURES)}")


@dataclass(frozen=True)
class Capabilities:
    """See the module docstring."""

    on_policy_only: bool = True
    exact_origins: frozenset = frozenset()
    needs: tuple[Need, ...] = ()


class Capable:
    """Mixin of every part of a spec: its capabilities record (the safe defaults unless it says otherwise)."""

    def capabilities(self) -> Capabilities:
        """This configuration's capabilities (on-policy only, exact origins, backend features it needs)."""
        return Capabilities()


def parts(spec):
    """(path, part) of every part of a resolved spec that declares capabilities: the spec sections, every source, the
    guide, each term's signal and objective, and the components inside a component's fields (an objective's
    estimator and token selection)."""
    out = [(("policy",), spec.policy), (("sync",), spec.sync), (("train",), spec.train),
           (("rollout", "filter"), spec.rollout.filter)]
    comps = [(("sources", name), src) for name, src in spec.sources.items()]
    comps.append((("rollout", "guide"), spec.rollout.guide))
    comps.append((("rollout", "environment"), spec.rollout.environment))
    if spec.terms:
        for i, t in enumerate(spec.terms):
            comps += [(("terms", i, "signal"), t.signal), (("terms", i, "objective"), t.objective)]
    else:
        comps += [(("signal",), spec.signal), (("objective",), spec.objective)]
    for path, comp in comps:
        if comp is None:
            continue
        out.append((path, comp))
        for name in type(comp).model_fields:
            inner = getattr(comp, name, None)
            if isinstance(inner, Capable) and inner is not comp:
                out.append((path + (name,), inner))
    return out


def needs(spec) -> list[tuple[tuple, Need]]:
    """(the path of the field that asks, the need) for every backend feature a resolved spec's parts rely on."""
    return [(path + need.field, need) for path, part in parts(spec) for need in part.capabilities().needs]


def departures(part) -> list[str]:
    """The fields of a part (a pydantic model) whose value differs from the field's default, in declaration order;
    nested parts compare by their dumped settings. A backend mapping that carries some fields reads this to see
    whether a field it does not carry was set away from its default (DESIGN.md section 11, "Backend mappings")."""
    def plain(value):
        return value.model_dump() if hasattr(value, "model_dump") else value

    out = []
    for name, info in type(part).model_fields.items():
        if plain(getattr(part, name)) != plain(info.get_default(call_default_factory=True)):
            out.append(name)
    return out
