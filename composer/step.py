"""The training step, written once: three declared parts that both backends run (DESIGN.md section 8).

  1. per row           the rollout of one row: the guide's program (components/guides), then each term's row
                       target (a term that trains on part of the row: InT online) and the behaviour log-probs of
                       guide tokens an objective reads. `row_program` (OpenRLHF's agent: one row at a time);
                       `rollout` (Lightning: the same guide programs driven in lockstep, composer/runtime/rollout.py,
                       row targets through the signals' batched `apply`).
  2. whole step        over every row of the step (whole groups): the rollout filter, each term's signal
                       (`sample`), the initial log-probs an objective reads, the old policy's per-token entropy an
                       entropy token selection reads, each term's advantages (and the objective's step-wide token
                       selection: `advantages`), its gate's rows (`apply_gates`,
                       `row_masks`), and each term's step-wide normaliser (`normalisers`).
  3. per micro-batch   `loss`: sum_k w_k c_k L_k(batch_k, view, A_k) minus the entropy bonus, c_k the part's share of
                       term k's normaliser (`shares`: micro-batches and ranks add up to the loss of the whole step).
                       Every part holds whole groups (`mini_batches`; Lightning's DDP ranks take whole prompts), so a
                       term whose loss couples the rows of a group (`Objective.couples_rows`: a DPO pair) sees its
                       pairs together, and its normaliser (the pairs) adds up over the parts; a backend that splits
                       groups lacks the capability `coupled_rows` and refuses such a term at compile.

`at` is the Plan at the step (composer/plan/plan.py, `Plan.at(step)`): the segment's resolved spec and every number
resolved at that step (term weights, objectives' coefficients, the entropy bonus). Lightning runs the parts in order
(composer/backends/lightning/module.py `step_loss`); OpenRLHF places part 1 in its agent, part 2 in its experience
maker and part 3 in its actor's loss (composer/backends/openrlhf/). A backend supplies the data and the forward
passes (`forward(batch, want_logits, read) -> PolicyView`); it computes none of these quantities. A new part of a
method is added here, once, and in the component that declares it (docs/architecture.md, "Adding a part").

Terms that view one rollout share its tokens, its policy forward and its split into mini-batches: `forwards` is the
one place that decides which batches share a rollout.
"""

from __future__ import annotations

from dataclasses import replace

from components.objectives.base import zero_advantage_fraction
from composer import filters, gates  # by module: a patched function (tests/mutations.py) is the one that runs
from composer.batch import PolicyView, TrajectoryBatch, concat
from composer.checks.terms import rolls_out, scored_origins
from composer.episodes import facts as episode_facts
from composer.lazy import torch
from composer.origins import NEVER_LOSS
from composer.protocol import POLICY, Score, fill_scores, plain_row

# ------------------------------------------------------------------------------------------- part 1: rows


def row_program(ctx, at, example, index: int, plain: bool = False):
    """Program of rollout `index` of `example` under the Plan at the step: the segment's guide writes the row (`plain`:
    plain sampling, an evaluation row), each term's row target cuts it, then the guide-written tokens an objective
    reads get the rollout weights' log-probs. Returns (trace, weight): the weight a row target gives the row (0:
    nothing to train), else the trace's."""
    n = at.spec.rollout.samples_per_prompt
    trace = yield from (plain_row(ctx, example) if plain else at.spec.rollout.guide.row(ctx, example, index, n))
    weight = trace.weight
    for term in at.terms:
        target = term.signal.row_target(ctx, example, trace)
        if target is not None:
            trace, weight = yield from target
    yield from scored_program(at, trace)
    return trace, weight


def scored_program(at, trace):
    """Program: the rollout weights' log-probs of the trace's guide-written tokens of the origins an objective of the
    step reads (`scored_origins`), filled into the trace in place."""
    scored = scored_origins(at.spec)
    if any(p.logprobs is None and p.origin in scored for p in trace.pieces):
        fill_scores(trace, (yield Score(trace.tokens, len(trace.prompt), POLICY)), scored)
    return trace


def rollout(ctx, at, examples) -> tuple[TrajectoryBatch, list]:
    """The step's rollout (Lightning: every row's guide program in lockstep), under rollout.filter when it is
    active -> (batch, the examples of its prompts)."""
    spec = at.spec
    n = spec.rollout.samples_per_prompt
    if spec.rollout.filter.active:  # filters run before any term reads the rollout
        return filters.filtered_rollout(ctx, examples, n)
    return spec.rollout.guide.rollout(ctx, examples, n), examples


# ------------------------------------------------------------------------------------- part 2: whole step


def collect(ctx, at, examples) -> list[TrajectoryBatch]:
    """The step's batches, one per term. With `sync.reuse`, the rollouts sampled right after a sync are stored and
    trained on at every step until the next sync; `clear_buffer: false` keeps older ones too."""
    sync = at.spec.sync
    if not sync.reuse:
        return sample(ctx, at, examples)
    version = ctx.engine.last_sync
    if ctx.state.buffer and ctx.state.buffer_version == version:
        ctx.log(buffer_reused=1.0)
        return ctx.state.buffer
    fresh = sample(ctx, at, examples)
    if ctx.state.buffer and not sync.clear_buffer:
        fresh = [concat([old, new], ctx.pad_id) for old, new in zip(ctx.state.buffer, fresh)]
    ctx.state.buffer, ctx.state.buffer_version = fresh, version
    ctx.log(buffer_reused=0.0, buffer_rows=float(fresh[0].size))
    return fresh


def sample(ctx, at, examples) -> list[TrajectoryBatch]:
    """One batch per term: one shared rollout for every term that needs rollouts, each term's signal filling its
    own view of it (or building its own batch), the initial log-probs once per rollout, each term's advantages
    over the whole step's groups, then the gates."""
    spec = at.spec
    shared: TrajectoryBatch | None = None
    if spec.rollout.filter.active and rolls_out(spec):
        shared, examples = rollout(ctx, at, examples)
    out, views = [], []  # views[k]: term k's batch is a view of the shared rollout
    by_term: dict[str, dict] = {}  # what each term's signal logged: per term when several terms log a key
    for term in at.terms:
        sig, obj = term.signal, term.declared
        if sig.makes_batch:
            batch = sig.make_batch(ctx, examples)
        else:
            if shared is None:
                shared, examples = rollout(ctx, at, examples)
            batch = shared.term_view()
        step_metrics, ctx.metrics = ctx.metrics, {}
        try:
            batch = sig.apply(ctx, batch)
        finally:
            by_term[term.name], ctx.metrics = ctx.metrics, step_metrics
        ctx.metrics.update(by_term[term.name])
        views.append(shared is not None and batch.tokens is shared.tokens)  # a signal may build a new batch
        if obj.wants_initial and batch.initial_logprobs is None:
            owner = shared if views[-1] else batch  # computed once per rollout
            if owner.initial_logprobs is None:
                owner.initial_logprobs = ctx.initial_logprobs(owner)
            batch.initial_logprobs = owner.initial_logprobs
        if obj.wants_old_entropy and batch.old_entropy is None:  # H_t of the policy at the step's start, before any
            owner = shared if views[-1] else batch  # update (one forward with the full logits, once per rollout)
            if owner.old_entropy is None:
                owner.old_entropy = ctx.old_entropy(owner)
            batch.old_entropy = owner.old_entropy
        if term.declared.value_model() is not None and batch.values is None:  # a critic's old values (ppo), which
            batch.values = ctx.critic_values(term.name, term.declared, batch)  # the advantages turn into GAE
        batch.advantages = advantages(term, batch)
        out.append(batch)
    if at.many:  # e.g. two distillation terms' teacher_kl_estimate: each under its term's name
        for name, logged in by_term.items():
            ctx.metrics.update({f"{name}/{k}": v for k, v in logged.items()})
        for k in {k for logged in by_term.values() for k in logged}:
            if sum(k in logged for logged in by_term.values()) > 1:
                ctx.metrics.pop(k, None)  # no single value would be right
    if any(term.gate is not None for term in at.terms):
        ctx.log(**apply_gates(at, out, views, shared,
                              lambda src: torch.tensor(ctx.source(src).success(ctx, shared), dtype=torch.bool)))
    return out


def advantages(term, batch: TrajectoryBatch):
    """Term `term`'s per-row advantages [B] over the whole step's groups (None: its objective has none); its
    objective's step-wide token selection is made here too (grpo's `token_selection`)."""
    adv = term.declared.advantages(batch)
    return None if adv is None else adv.detach()


def apply_gates(at, batches: list[TrajectoryBatch], views: list[bool], rollout: TrajectoryBatch | None,
                success_of) -> dict[str, float]:
    """Each gated term's rows (composer/gates.py) as its batch's row_mask, from the step's rollout: success by the
    gate's outcome_reward source (`success_of(source) -> [N] bool` over the rollout's rows), groups, surprisal of
    the behaviour log-probs; a batch the term's signal built (`views[k]` False) takes its prompt's rollouts' gate.
    -> each gate's fraction, `<term>/gate_frac`."""
    success, metrics = {}, {}
    for term, b, view in zip(at.terms, batches, views):
        gate = term.gate
        if gate is None:
            continue
        src = gates.gate_source(gate, at.spec)
        if src not in success:
            success[src] = success_of(src)
        ok = success[src]
        if view:  # a view of the rollout: its own rows
            surprisal = gates.row_surprisal(rollout.behavior_logprobs, rollout.policy_mask & rollout.known_mask) \
                if gate.entropy_above_quantile is not None or gate.entropy_below_quantile is not None else None
            rows = gates.gate_rows(gate, ok, rollout.group, surprisal)
            b.row_mask = rows if b.row_mask is None else rows & b.row_mask  # a filter may have masked rows
        else:  # a batch the signal built (SFT on references): its prompt's rollouts decide
            if gate.row_facts():
                raise ValueError(f"term {term.name}: its gate tests {', '.join(gate.row_facts())} of rollout rows, "
                                 "and its signal trains on rows it built (validation refuses this)")
            b.row_mask = gates.gate_by_prompt(gate, ok, rollout.prompt_index, b.prompt_index)
        metrics.update(gates.gate_metrics(term.name, b.row_mask))
    return metrics


def row_masks(at, rollout: TrajectoryBatch, eos_id: int) -> list:
    """Each term's rows of a step whose every term trains on a view of one rollout (OpenRLHF), [N] bool or None
    (every row): the rows rollout.filter.truncated: mask keeps (those that ended before the length cap), and the
    term's gate, success being the rollout's reward against the gate source's success_threshold."""
    keep = ~filters.truncated_rows(rollout, eos_id) if at.spec.rollout.filter.truncated == "mask" else None
    views = [replace(rollout, row_mask=keep) for _ in at.terms]
    if any(term.gate is not None for term in at.terms):
        if rollout.rewards is None:
            raise ValueError("a term gate needs the samples' rewards, and this step has none")
        apply_gates(at, views, [True] * len(views), rollout,
                    lambda src: rollout.rewards >= at.spec.sources[src].success_threshold)
    return [v.row_mask for v in views]


def normalisers(at, batches: list[TrajectoryBatch]) -> dict[int, float]:
    """Each term's normaliser over `batches` (the whole step's, or one part's): what its loss divides by."""
    return {t.index: float(t.objective.normalizer(b)) for t, b in zip(at.terms, batches) if t.objective is not None}


def shares(part: dict[int, float], whole: dict[int, float], parts: int = 1) -> dict[int, float]:
    """c_k of one part of the step (a micro-batch, a rank's rows): its normaliser `part[k]` over term k's step-wide
    normaliser `whole[k]`, times the number of `parts` the backend averages over (DDP's ranks; DeepSpeed's ranks x
    gradient accumulation steps), so the parts' scaled losses add up to the loss of the whole step as one batch."""
    return {k: part[k] * parts / max(whole[k], 1e-12) for k in whole if k in part}


def row_shares(at, rows, step_rows, parts: int = 1) -> dict[int, float]:
    """Shares by sequences, for a part whose step-wide normalisers were not recorded: its rows over the step's."""
    return {t.index: rows / step_rows * parts for t in at.terms}


def gate_facts(at, batches: list[TrajectoryBatch]) -> dict[str, float]:
    """`<term>/gate_frac` of the rows of these batches that their terms' row masks keep."""
    return {k: v for t, b in zip(at.terms, batches) if b.row_mask is not None
            for k, v in gates.gate_metrics(t.name, b.row_mask).items()}


# --------------------------------------------------------------------------------- part 3: micro-batch loss


def forwards(batches: list[TrajectoryBatch]) -> list[int]:
    """For each term's batch, the index of the first batch holding the same tokens: terms that view one rollout
    share its policy forward, its old log-probs and its split into mini-batches (the one place sharing is read)."""
    first: dict[int, int] = {}
    return [first.setdefault(id(b.tokens), k) for k, b in enumerate(batches)]


def read_masks(at, batches: list[TrajectoryBatch]) -> dict[int, torch.Tensor]:
    """Per forward (`forwards`): the positions any term's loss reads (`Objective.read_mask`), and the first batch's
    response tokens, whose entropy `loss` logs and may add as a bonus."""
    out: dict[int, torch.Tensor] = {}
    for term, b, f in zip(at.terms, batches, forwards(batches)):
        m = term.objective.read_mask(b)
        out[f] = m if f not in out else out[f] | m
    first = batches[0]
    out[0] = out[0] | (first.response_mask & first.attention_mask)
    return out


@torch.no_grad()
def old_logprobs(batches: list[TrajectoryBatch], forward) -> None:
    """batch.old_logprobs [B, T] of every batch: the policy's log-probs before the step's first update (one forward
    per rollout; terms that share a rollout share the tensor)."""
    done: dict[int, torch.Tensor] = {}
    for b, f in zip(batches, forwards(batches)):
        if f not in done:
            done[f] = forward(b, False, None).logprobs.detach()
        b.old_logprobs = done[f]


def loss(at, batches: list[TrajectoryBatch], forward, shares: dict | None = None, record=None,
         facts: bool = True, entropy: bool = True, values=None) -> tuple[torch.Tensor, dict]:
    """sum_k w_k c_k L_k over the terms (`shares[k]` = c_k, 1 by default), minus the entropy bonus when `entropy` (a
    backend whose trainer adds its own declares so); metrics per term. `forward(batch, want_logits, read)` is the
    backend's policy forward, called once per rollout; `record(kind, **data)` sees each term's loss (the referee);
    `facts`: also the data's facts (rewards, advantages' zero groups) over these batches; `values(term, batch,
    view)`: the view a term's loss reads, with a critic head's values on the policy's network (ppo) where it has one."""
    groups = forwards(batches)
    wants: dict[int, bool] = {}
    for term, f in zip(at.terms, groups):
        wants[f] = wants.get(f, False) or term.objective.wants_logits
    read = read_masks(at, batches)
    views: dict[int, PolicyView] = {}
    total, metrics = 0.0, {}
    for term, b, f in zip(at.terms, batches, groups):
        if f not in views:
            views[f] = forward(b, wants[f], read[f])
        obj = term.objective
        view = views[f] if values is None else values(term, b, views[f])
        value, m = obj.loss(b, view, b.advantages)
        if facts:
            m = {**obj.advantage_metrics(b), **m}
        if record is not None:
            record("term_loss", term=term.name, objective=obj, batch=b, view=view, loss=value, weight=term.weight)
        total = total + term.weight * (shares or {}).get(term.index, 1.0) * value
        metrics.update({(f"{term.name}/{k}" if at.many else k): v for k, v in m.items()})
        if at.many:
            metrics[f"{term.name}/loss"] = float(value.detach())
        if term.scheduled:  # a scheduled weight: its value at this step
            metrics[f"{term.name}/weight" if at.many else "weight"] = float(term.weight)
    if entropy:
        total = total - entropy_bonus(at, batches[0], views[0], metrics)
    if facts:
        metrics.update(step_facts(at, batches))
    metrics.update(mismatch(batches[0], views[0]))
    return total, metrics


def mismatch(batch: TrajectoryBatch, view: PolicyView) -> dict[str, float]:
    """The training-inference mismatch on the policy's sampled tokens, logged every step on every engine (DESIGN.md
    section 11): d_t = log pi_old(y_t) - log mu(y_t), the trainer's log-prob at the step's start (`old_logprobs`, or
    the forward of the step's single update, which is the same weights) over the sampler's.
      mismatch/kl          mean_t (log mu - log pi_old): the k1 estimate of KL(mu || pi_old) on the sampled tokens
      mismatch/rho_min, _mean, _max    of rho_t = exp(d_t);  mismatch/abs_max  max_t |d_t|
    Nothing when the batch holds no policy token with a known behaviour log-prob."""
    m = batch.policy_mask & batch.known_mask  # [B, T]
    if not bool(m.any()):
        return {}
    trainer = batch.old_logprobs if batch.old_logprobs is not None else view.logprobs
    d = (trainer.detach().double() - batch.behavior_logprobs.to(trainer.device).double())[m.to(trainer.device)]  # [N]
    rho = torch.exp(d.clamp(-20.0, 20.0))
    return {"mismatch/kl": float(-d.mean()), "mismatch/rho_min": float(rho.min()),
            "mismatch/rho_mean": float(rho.mean()), "mismatch/rho_max": float(rho.max()),
            "mismatch/abs_max": float(d.abs().max())}


def entropy_bonus(at, first: TrajectoryBatch, view: PolicyView, metrics: dict):
    """train.entropy_coef x the policy's token-mean entropy on the first batch's response tokens (0 without a
    coefficient); logs `entropy` (and the coefficient, when scheduled)."""
    mask = first.response_mask & first.attention_mask & ~first.mask(NEVER_LOSS)  # never an environment's token
    ent = (view.entropy * mask).sum() / mask.sum().clamp(min=1)
    if at.entropy_scheduled:
        metrics["entropy_coef"] = float(at.entropy_coef)
    if mask.any():  # a batch with no response tokens (e.g. no SFT targets this step) has no entropy
        metrics["entropy"] = float(ent.detach())
    return at.entropy_coef * ent if at.entropy_coef else 0.0


def mini_batches(batches: list[TrajectoryBatch], n: int) -> list[list[TrajectoryBatch]]:
    """The step's batches (one per term) split into `n` mini-batches of whole groups, in group order: [n][terms].
    Terms that share a rollout are split the same way and keep sharing its tokens (one forward per rollout). Whole
    groups keep every pair of a term that couples rows (`Objective.couples_rows`) inside one mini-batch."""
    if n == 1:
        return [batches]
    out: list[list[TrajectoryBatch]] = [[] for _ in range(n)]
    split: dict[int, tuple[list, list]] = {}
    for b, f in zip(batches, forwards(batches)):
        if f not in split:
            ids = torch.unique(b.group)  # sorted group ids
            if ids.numel() < n:
                raise ValueError(f"train.mini_batches is {n}, but this step's batch holds {ids.numel()} groups: "
                                 "mini-batches hold whole groups; use fewer mini-batches or more prompts per step")
            rows = [torch.nonzero(torch.isin(b.group, part)).flatten() for part in torch.tensor_split(ids, n)]
            split[f] = (rows, [b.select(r) for r in rows])
            parts = split[f][1]
        else:
            rows, first = split[f]
            parts = [replace(b.select(r), tokens=s.tokens, origin=s.origin) for r, s in zip(rows, first)]
        for j, part in enumerate(parts):
            out[j].append(part)
    return out


# ------------------------------------------------------------------------------------------ the step's facts


def step_facts(at, batches: list[TrajectoryBatch]) -> dict[str, float]:
    """The data's facts over the step's batches: the first rewarded batch's (`batch_facts`), and
    `source_reward/<source>`, the mean reward of each reward source a term's signal reads."""
    out = batch_facts(next((b for b in batches if b.rewards is not None), batches[0]))
    for term, b in zip(at.terms, batches):
        for source in term.signal.ref_names().get("source", [])[:1]:  # a signal's `source` reference: its reward
            if b.rewards is not None and f"source_reward/{source}" not in out:
                out[f"source_reward/{source}"] = float(b.rewards.float().mean())
    return out


def batch_facts(batch: TrajectoryBatch) -> dict[str, float]:
    """Per-step facts about the data: reward, length, off-policy tokens, groups with no signal; under an environment,
    its episodes' facts (composer/episodes.py `facts`: env/turns, env/tool_calls, env/tool_errors, env/env_tokens)."""
    out = {}
    resp = batch.response_mask
    n_resp = resp.sum().clamp(min=1)
    out["response_len"] = float(resp.sum(1).float().mean())
    out["response_tokens"] = float(resp.sum())  # so that shares over many steps can be weighted by tokens
    off = batch.mask(("guide_prefix", "guide_intervention", "demonstration")) & resp
    out["offpolicy_token_frac"] = float(off.sum() / n_resp)
    out.update(episode_facts(batch.notes))  # env/turns, env/tool_calls, env/tool_errors, env/env_tokens, ...
    if batch.rewards is not None:
        r = batch.rewards
        out["reward_mean"] = float(r.mean())
        out["zero_advantage_frac"] = float(zero_advantage_fraction(r, batch.group))
        if batch.advantages is not None:  # per row, or per response token (a critic's GAE)
            a = batch.advantages.abs().float()
            out["adv_abs_mean"] = float(a.mean() if a.dim() == 1 else a[resp.to(a.device)].mean())
        if batch.guided is not None and batch.guided.any() and (~batch.guided).any():
            out["reward_guided"] = float(r[batch.guided].mean())
            out["reward_control"] = float(r[~batch.guided].mean())
    return out
