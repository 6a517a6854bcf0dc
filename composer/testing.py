"""The component contract's test kit, for plugin authors (and run over every built-in in tests/test_contract_kit.py).

    from composer.testing import check_objective
    check_objective(MyObjective())          # AssertionError naming what broke, else a dict of the figures

What it checks of an objective, on synthetic batches that hold every token origin, padding, empty rows,
sequence weights, several advantage groups and the fields a signal would fill:
  1. micro-batches add up: the step's loss equals sum_m loss(m) * normalizer(m) / normalizer(step) over
     any split of the rows (OpenRLHF's micro-batches, DDP's ranks), advantages taken over whole groups; any split
     into whole groups for an objective whose loss couples the rows of a group (`couples_rows`: a pair term);
  2. the normaliser matches the aggregation: with a declared `reduction()` the normaliser is its
     `aggregate_count`, and the split into single rows adds up too (a loss that aggregates differently
     from what its normaliser says fails here);
  3. the backends agree: one batch (`advantages`, then `loss`) and the step's micro-batches as OpenRLHF trains them
     (composer/step.py: `advantages` over the step, each micro-batch's `loss` scaled by its `shares` with gradient
     accumulation, each backward divided by gas as DeepSpeed does) give the same loss and the same gradient;
  4. `loss` reads the policy only where `read_mask` says;
  5. per-row advantages have their reference (`reference_advantages`, the referee's formula) and equal it;
  6. a declared `reference_loss` (the referee's loss) equals the loss and its gradient.
`check_component` checks the declared parts every component shares (hooks return what they declare).
"""

from __future__ import annotations

import dataclasses

from composer.origins import CODE

TOL = 1e-5


# ------------------------------------------------------------------------------------ synthetic data

def synthetic_batch(B: int = 8, T: int = 14, V: int = 11, seed: int = 0):
    """(batch, logits): a TrajectoryBatch over every origin and a leaf [B, T, V] logits tensor the policy view
    is computed from (so gradients can be compared). Rows: 2 prompt groups x (control, guided), right
    padding of varying length, one row with no response, sequence weights in {0, 0.5, 1}."""
    import torch

    from composer.batch import TrajectoryBatch

    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(1, V, (B, T), generator=g)
    origin = torch.full((B, T), CODE["policy"], dtype=torch.uint8)
    origin[:, :3] = CODE["prompt"]
    for i in range(B):
        if i % 4 == 1:
            origin[i, 3:5] = CODE["guide_prefix"]
        if i % 4 == 2:
            origin[i, 6:8] = CODE["guide_intervention"]
        if i % 4 == 3:
            origin[i, 3:6] = CODE["demonstration"]
        pad = (i * 3) % 5
        if pad:
            origin[i, T - pad:] = CODE["pad"]
    origin[B - 1, 3:] = CODE["pad"]  # a row with nothing to train on

    def rand(*shape):
        return torch.rand(*shape, generator=g)

    batch = TrajectoryBatch(
        tokens=tokens, origin=origin,
        behavior_logprobs=-rand(B, T) * 2 - 0.05,
        group=torch.tensor([(i // 2) % 2 * 2 + (i % 2) for i in range(B)]),  # prompt x tag
        control=torch.tensor([i % 2 == 0 for i in range(B)]),
        rewards=(rand(B) > 0.5).float(),
        teacher_logprobs=-rand(B, T) * 2 - 0.05,
        teacher_logits=torch.randn(B, T, V, generator=g),
        initial_logprobs=-rand(B, T) * 2 - 0.05,
        seq_weight=torch.tensor([[1.0, 0.5, 0.0, 1.0][i % 4] for i in range(B)]),
        prompt_index=torch.tensor([(i // 2) % 2 for i in range(B)]),
        guided=torch.tensor([i % 2 == 1 for i in range(B)]),
        values=torch.randn(B, T, generator=g),  # a critic's old values (ppo)
        old_entropy=rand(B, T) * 2,  # the old policy's H_t (an entropy token selection)
    )
    logits = torch.randn(B, T, V, generator=g).requires_grad_(True)
    return batch, logits


def view_of(batch, logits, rows=None):
    """PolicyView of the rows `rows` (all by default): log-probs of each token under `logits` (0 at t = 0)."""
    import torch

    from composer.batch import PolicyView

    lg = logits if rows is None else logits[torch.as_tensor(rows)]
    logp_all = torch.log_softmax(lg, -1)  # [b, T, V]
    lp = logp_all.gather(-1, batch.tokens[..., None]).squeeze(-1)  # [b, T]
    lp = torch.cat([torch.zeros_like(lp[:, :1]), lp[:, 1:]], 1)
    ent = -(logp_all.exp() * logp_all).sum(-1)
    return PolicyView(lp, logits=lg, entropy=ent)


def _split(n: int, parts: int) -> list[list[int]]:
    return [list(range(n))[k::parts] for k in range(parts)]  # interleaved: every micro-batch mixes groups


def _parts(obj, batch, parts: int) -> list[list[int]]:
    """The rows of each part of a split of `batch` into `parts`: interleaved rows, or for an objective whose loss
    couples the rows of a group (`couples_rows`: a pair term) interleaved whole groups (at most one part per group),
    as every backend that runs it splits (composer/step.py `mini_batches`, DDP's ranks)."""
    if type(obj).couples_rows is None:
        return _split(batch.size, parts)
    ids = sorted(set(batch.group.tolist()))
    return [[i for i, g in enumerate(batch.group.tolist()) if g in ids[k::parts]] for k in range(min(parts, len(ids)))]


def _step_loss(obj, batch, logits):
    """The loss of the whole step as one batch (advantages over whole groups first)."""
    adv = obj.advantages(batch)
    return obj.loss(dataclasses.replace(batch, advantages=adv), view_of(batch, logits), adv)[0], adv


def _close(a, b, what: str, tol: float = TOL) -> None:
    a, b = (float(x.detach()) if hasattr(x, "detach") else float(x) for x in (a, b))
    assert abs(a - b) <= tol * max(1.0, abs(a), abs(b)), f"{what}: {a!r} != {b!r}"


# ------------------------------------------------------------------------------------------- checks

def check_micro_batches(obj, batch, logits, parts: int = 3) -> float:
    """Check 1: sum over micro-batches m of loss(m) * normalizer(m) / normalizer(step) == loss(step)."""
    import torch

    whole, adv = _step_loss(obj, batch, logits)
    norm = float(obj.normalizer(batch))
    total = 0.0
    for rows in _parts(obj, batch, parts):
        mb = batch.select(rows)
        a = None if adv is None else adv[torch.as_tensor(rows)]
        mb = dataclasses.replace(mb, advantages=a)
        part = obj.loss(mb, view_of(mb, logits, rows), a)[0]
        total = total + part * float(obj.normalizer(mb)) / max(norm, 1e-12)
    _close(total, whole, f"{obj.kind_name()}: micro-batch losses ({parts} parts) do not add up to the step's loss")
    return float(whole.detach())


def check_normalizer(obj, batch, logits) -> None:
    """Check 2: the normaliser is the declared aggregation's count, and rows one by one add up too."""
    from components.objectives.base import aggregate_count

    r = obj.reduction()
    if r is not None:
        want = aggregate_count(obj.loss_mask(batch), r.mode, r.norm_const,
                               seq_weight=batch.weights() if r.weighted else None)
        _close(obj.normalizer(batch), want, f"{obj.kind_name()}: normalizer() is not the count of reduction() {r}")
    check_micro_batches(obj, batch, logits, parts=batch.size)


def check_backends_agree(obj, batch, logits, micro: int = 2, gas: int = 2) -> None:
    """Check 3: the Lightning path and the OpenRLHF path give the same loss and gradient on one step."""
    import torch

    from composer import step
    from composer.plan.plan import StepPlan, Term

    at = StepPlan(0, None, (Term(0, "term0", None, obj, 1.0, declared=obj),), 0.0, False)
    lit, _ = _step_loss(obj, batch, logits)
    (g_lit,) = torch.autograd.grad(lit, logits, allow_unused=True)
    adv = step.advantages(at.terms[0], batch)  # the experience maker's step over every sample
    whole = step.normalisers(at, [batch])
    rlhf = 0.0
    for rows in _parts(obj, batch, micro):
        mb = dataclasses.replace(batch.select(rows), advantages=None if adv is None else adv[torch.as_tensor(rows)])
        shares = step.shares(step.normalisers(at, [mb]), whole, parts=gas)  # x gas: DeepSpeed's accumulation
        view = view_of(mb, logits, rows)
        loss, _m = step.loss(at, [mb], lambda b, want, read, view=view: view, shares, facts=False, entropy=False)
        rlhf = rlhf + loss / gas  # DeepSpeed divides every micro-batch's backward by gas
    _close(rlhf, lit, f"{obj.kind_name()}: the OpenRLHF loss path differs from the Lightning step")
    if g_lit is not None:
        (g_rlhf,) = torch.autograd.grad(rlhf, logits, allow_unused=True)
        diff = float((g_rlhf - g_lit).abs().max())
        assert diff <= TOL * max(1.0, float(g_lit.abs().max())), \
            f"{obj.kind_name()}: OpenRLHF and Lightning gradients differ by {diff}"


def check_objective(obj, seeds=(0, 1)) -> dict:
    """Every objective check on synthetic batches; returns {"loss": step loss of the first batch}."""
    out = {}
    for seed in seeds:
        batch, logits = synthetic_batch(seed=seed)
        loss = check_micro_batches(obj, batch, logits)
        check_normalizer(obj, batch, logits)
        check_backends_agree(obj, batch, logits)
        check_reads(obj, batch, logits)
        check_reference_advantages(obj, batch)
        check_reference_loss(obj, batch, logits)
        out.setdefault("loss", loss)
    return out


def check_reference_advantages(obj, batch) -> None:
    """Check 5: an objective with per-row advantages declares their reference (`reference_advantages`, the
    referee's formula written again in its own file; DESIGN.md section 10), and it equals `advantages` on the
    batch's rewards, groups and control rows. Without one, `composer check` reports the advantages not covered."""
    adv = obj.advantages(batch)
    if adv is None or adv.dim() != 1:  # no advantage, or per-token ones (a critic: its own referee)
        return
    want = obj.reference_advantages(batch.rewards.double().tolist(), batch.group.tolist(), batch.control.tolist(),
                                    batch.mask(("policy",)).sum(-1).tolist())
    assert want is not None, (f"{obj.kind_name()}: advantages() without reference_advantages(): the referee cannot "
                              "recompute them (write the formula again, plainly, in the component's file)")
    got = adv.double().tolist()
    bad = [(i, got[i], want[i]) for i in range(len(got)) if abs(got[i] - want[i]) > 1e-4 * (1 + abs(want[i]))]
    assert not bad, f"{obj.kind_name()}: advantages() and reference_advantages() differ (row, run, reference): {bad[:4]}"


def check_component(c) -> None:
    """What every component declares is of the declared kind (a guide's reads, an objective's reduction)."""
    from components.objectives.base import AGGREGATIONS, Objective
    from composer.contract import Guide, Signal, Source

    if isinstance(c, Objective):
        r = c.reduction()
        assert r is None or r.mode in AGGREGATIONS, f"{c.kind_name()}: reduction mode {r.mode!r} is not an aggregation"
        assert r is not None or type(c).normalizer is not Objective.normalizer, \
            f"{c.kind_name()}: neither reduction() nor normalizer()"
    elif isinstance(c, Guide):
        assert set(c.writes_now()) <= set(type(c).writes), f"{c.kind_name()}: writes_now() beyond `writes`"
        assert all(w in ("initial", "sampler") for w in c.reads().values()), f"{c.kind_name()}: reads() {c.reads()}"
    elif isinstance(c, Signal):
        assert c.usage in ("", "target", "teacher", "reward"), f"{c.kind_name()}: usage {c.usage!r}"
    elif isinstance(c, Source):
        assert c.pi in ("prior", "posterior"), f"{c.kind_name()}: pi {c.pi!r}"
    else:
        raise TypeError(f"{type(c).__name__} is not a component of the contract")


def check_reads(obj, batch, logits) -> None:
    """Check 4: `loss` reads the policy only at `read_mask`: a view holding 0 everywhere else (log-probs,
    entropies, logits, as the policy forward leaves them) gives the same loss, gradient and metrics."""
    import math

    import torch

    from composer.batch import PolicyView

    adv = obj.advantages(batch)
    b = dataclasses.replace(batch, advantages=adv)
    read = obj.read_mask(b)  # [B, T]
    full = view_of(batch, logits)
    cut = PolicyView(full.logprobs.masked_fill(~read, 0.0), logits=full.logits.masked_fill(~read[..., None], 0.0),
                     entropy=full.entropy.masked_fill(~read, 0.0))
    (want, m_want), (got, m_got) = obj.loss(b, full, adv), obj.loss(b, cut, adv)
    what = f"{obj.kind_name()}: loss reads the policy outside read_mask()"
    _close(got, want, what)
    if want.requires_grad:
        (g_want,) = torch.autograd.grad(want, logits, allow_unused=True, retain_graph=True)
        (g_got,) = torch.autograd.grad(got, logits, allow_unused=True)
        if g_want is not None:
            assert g_got is not None and float((g_got - g_want).abs().max()) <= TOL * max(1.0, float(g_want.abs().max())), \
                f"{what} (its gradient differs)"
    for k, v in m_want.items():
        if not (isinstance(v, float) and math.isnan(v) and math.isnan(m_got[k])):
            _close(m_got[k], v, f"{what} (metric {k})")


def check_reference_loss(obj, batch, logits) -> None:
    """Check 6: where the objective declares `reference_loss` (the referee's loss, in its own file), its value and
    its gradient d loss / d log pi equal the loss's on the batch (loss tokens: `loss_mask`)."""
    import torch

    adv = obj.advantages(batch)
    b = dataclasses.replace(batch, advantages=adv)
    view = view_of(batch, logits)
    mask = obj.loss_mask(b)
    from composer.lang.curves import value_at

    old = batch.old_logprobs if batch.old_logprobs is not None else batch.behavior_logprobs
    inputs = {"old": old, "initial": batch.initial_logprobs,
              "advantages": None if adv is None else adv.double().tolist(),
              "kl_coef": float(value_at(getattr(obj, "kl_coef", 0.0), 0)) if obj.wants_initial else 0.0,
              "token_select": b.token_select}  # a step-wide token selection `advantages` made, if any
    want = obj.reference_loss(b, mask, view, inputs)
    if want is None:
        return
    loss, _ = obj.loss(b, view, adv)
    _close(loss, want["value"], f"{obj.kind_name()}: loss and reference_loss differ")
    (grad,) = torch.autograd.grad(loss, view.logprobs, allow_unused=True)
    grad = torch.zeros_like(view.logprobs) if grad is None else grad
    err = float((grad.double() - want["grad"]).abs().max())
    assert err <= TOL * max(1.0, float(want["grad"].abs().max())), \
        f"{obj.kind_name()}: the gradient of loss and of reference_loss differ (by {err:.3g})"
