"""Evaluation: greedy pass@1 of the current policy on each held-out tier, with no guide, scored by the spec's
verifier; with train.eval_k, also the unbiased pass@k of eval_k sampled answers per problem.

Which verifier scores: `train.eval_verifier` when given, else the verifier of the spec's outcome_reward
source (the one the training reward used), else the task's own (`math` for data files, `toy` for the toy
testbed). Each tier holds at most `train.eval_samples` problems (a data file's first rows). What was
generated is returned as records (`eval_samples.jsonl`: step, tier, row, prompt, response, answer, reward,
parsed answer and verifier detail), so a run and `composer eval` keep the same files.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import torch

from composer.runtime.engine import Sampling, hf_generate

EVAL_SAMPLES = "eval_samples.jsonl"


def eval_verifier(ctx) -> str:
    """The registered name of the verifier evaluation scores with (see the module docstring)."""
    spec = ctx.spec
    chosen = getattr(spec.train, "eval_verifier", None) if spec is not None else None
    if chosen:
        return ctx.task.verifier if chosen == "auto" else chosen
    from composer.runtime.binding import spec_verifiers

    found = spec_verifiers(spec, ctx.task) if spec is not None else []
    return found[0] if found else ctx.task.verifier


def eval_examples(ctx, examples: list) -> list:
    """The problems a tier is evaluated on: at most train.eval_samples (the first rows of a data file)."""
    n = getattr(getattr(ctx.spec, "train", None), "eval_samples", None)
    return list(examples) if n is None else list(examples)[:n]


def _record(tier: str, e, text: str, verdict, sample: int | None = None, truncated: bool = False) -> dict:
    """One eval_samples.jsonl row. `decoding`: `greedy` (the pass@1 answer) or `sampled` (one of train.eval_k
    answers for pass@k, numbered by `sample`); `truncated`: the answer was cut at max_new_tokens (no stop token)."""
    row = {"tier": tier, "row": e.row, "decoding": "greedy" if sample is None else "sampled", "prompt": e.prompt,
           "response": text, "answer": e.answer, "reward": float(verdict.reward),
           "parsed": getattr(verdict, "answer", None), "read": bool(verdict.parsed), "detail": verdict.detail,
           "truncated": bool(truncated)}
    if sample is not None:
        row["sample"] = sample
    return row


@torch.no_grad()
def _generate(ctx, policy, examples, sampling: Sampling, n: int = 1):
    """n answers per example; under rollout.environment, n episodes each, returned as their final answers (what the
    verifier reads: composer/episodes.py `episode_generations`)."""
    was_training = policy.training
    policy.eval()
    try:
        env = getattr(getattr(ctx.spec, "rollout", None), "environment", None)
        if env is not None and env.active:
            from composer.episodes import episode_generations

            return episode_generations(ctx, env, examples, n, lambda prompts, cap: hf_generate(
                policy, ctx.tokenizer, prompts, cap, sampling))
        prompts = [ctx.encode(e.prompt) for e in examples for _ in range(n)]
        return hf_generate(policy, ctx.tokenizer, prompts, ctx.max_new_tokens, sampling)
    finally:
        policy.train(was_training)


def pass_at_1(ctx, policy, examples, max_new_tokens: int | None = None, records: list | None = None,
              tier: str = "") -> float:
    """Greedy pass@1: the mean reward of one greedy answer per problem under the evaluation verifier."""
    if not examples:
        return float("nan")
    gens = _generate(ctx, policy, examples, Sampling(greedy=True))
    verify = ctx.verifier(eval_verifier(ctx))
    total = 0.0
    for g, e in zip(gens, examples):
        text = ctx.decode(g.tokens)
        v = verify(text, e)
        total += v.reward
        if records is not None:
            records.append(_record(tier, e, text, v, truncated=not g.finished))
    return total / len(examples)


def ks_up_to(n: int) -> list[int]:
    """1, 2, 4, ... up to n, and n itself."""
    ks, k = [], 1
    while k < n:
        ks.append(k)
        k *= 2
    return ks + [n]


def evaluate(ctx, policy, records: list | None = None, progress=None) -> dict[str, float]:
    """pass@1/<tier> for every held-out tier; with train.eval_k = n > 1 also pass@k/<tier> (k = 2, 4, .., n)
    and pass@1_sampled/<tier> from n sampled answers. `records` receives what was generated. `progress(line)`,
    when given, gets a line before and after each tier's generation (`composer eval`)."""
    import time

    out = {}
    n = getattr(getattr(ctx.spec, "train", None), "eval_k", 0) or 0
    tiers = list(ctx.task.eval.items())
    for i, (tier, exs) in enumerate(tiers, start=1):
        exs = eval_examples(ctx, exs)
        t0 = time.perf_counter()
        if progress:
            progress(f"eval {i}/{len(tiers)} {tier}: {len(exs)} problem(s), greedy"
                     + (f", then {n} sampled answers each" if n > 1 and exs else "") + " ...")
        out[f"pass@1/{tier}"] = pass_at_1(ctx, policy, exs, records=records, tier=tier)
        if n > 1 and exs:
            for k, v in pass_at_k(ctx, policy, exs, n=n, ks=ks_up_to(n), records=records, tier=tier).items():
                out[f"pass@{k}/{tier}" if k > 1 else f"pass@1_sampled/{tier}"] = v
        if progress:
            got = ", ".join(f"{k.split('/')[0]} {v:.3f}" for k, v in out.items() if k.endswith(f"/{tier}"))
            progress(f"eval {i}/{len(tiers)} {tier}: {got} ({time.perf_counter() - t0:.1f}s)")
    return out


def unbiased_pass_at_k(n: int, c: int, k: int) -> float:
    """Chen et al. 2021: 1 - C(n-c, k) / C(n, k), the chance that k of n samples include a correct one."""
    if n - c < k:
        return 1.0
    prob = 1.0
    for i in range(n - c + 1, n + 1):
        prob *= 1.0 - k / i
    return 1.0 - prob


def pass_at_k(ctx, policy, examples, n: int = 32, ks=(1, 2, 4, 8, 16, 32), temperature: float | None = None,
              records: list | None = None, tier: str = "") -> dict[int, float]:
    """Unbiased pass@k from n samples per problem at `temperature` (default: the rollout's sampling; no guide).
    A sample counts as correct when its reward is 1. The sampling has its own seed (train.seed + step), so it
    leaves the training's random stream as it was and a checkpoint evaluated alone draws the same samples."""
    sampling = ctx.sampling if temperature is None else Sampling(temperature=temperature)
    seed = (getattr(ctx, "seed", 0) + getattr(ctx, "step", 0)) % (2 ** 63)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        gens = _generate(ctx, policy, examples, sampling, n)
    verify = ctx.verifier(eval_verifier(ctx))
    out = {k: 0.0 for k in ks if k <= n}
    for i, e in enumerate(examples):
        c = 0
        for j, g in enumerate(gens[i * n:(i + 1) * n]):
            text = ctx.decode(g.tokens)
            v = verify(text, e)
            c += v.reward >= 1.0
            if records is not None:
                records.append(_record(tier, e, text, v, sample=j, truncated=not g.finished))
        for k in out:
            out[k] += unbiased_pass_at_k(n, c, k) / len(examples)
    return out


@torch.no_grad()
def heldout_entropy(ctx, policy, examples, n: int = 4, seed: int = 0) -> float:
    """Mean per-token entropy (nats) of the policy's next-token distribution at temperature 1 over its own
    responses to `examples` (n samples each, plain sampling: no top-p, no top-k, no guide).

    The off-policyness study compares methods by how far training narrowed the distribution; the training
    log's entropy is measured on each method's own rollouts at its own temperature (OPSD samples at 1.1, SFT
    logs demonstrations), so it compares different things. This one is the same for every method: the same
    held-out prompts, temperature 1, the same seed.
    """
    from composer.runtime.models import token_logprobs

    if not examples:
        return float("nan")
    was_training = policy.training
    policy.eval()
    try:
        prompts = [ctx.encode(e.prompt) for e in examples for _ in range(n)]
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            gens = hf_generate(policy, ctx.tokenizer, prompts, ctx.max_new_tokens, Sampling(temperature=1.0))
        device = next(policy.parameters()).device
        total, count = 0.0, 0
        for p, g in zip(prompts, gens):
            if not g.tokens:
                continue
            ids = torch.tensor([p + g.tokens], device=device)  # [1, P + R]
            _, _, ent = token_logprobs(policy, ids, torch.ones_like(ids))  # ent[:, t]: the step predicting ids[t]
            total += float(ent[0, len(p):].sum())
            count += len(g.tokens)
        return total / count if count else float("nan")
    finally:
        policy.train(was_training)


# ------------------------------------------------------------------------------------------ eval_samples.jsonl


def write_records(folder: Path, step: int, records: list[dict]) -> None:
    """Append one evaluation's generations to eval_samples.jsonl (one JSON object a line, with its step)."""
    if not records:
        return
    from composer import files

    path = Path(folder) / EVAL_SAMPLES
    with files.open_append(path, text=True, encoding="utf-8") as f:  # never through a link
        for r in records:
            f.write(json.dumps({"step": step, **r}, ensure_ascii=False) + "\n")


def prepare_records(folder: Path, resumed_at: int | None) -> None:
    """A resumed run evaluates its later steps again: keep only the rows of steps before `resumed_at`."""
    path = Path(folder) / EVAL_SAMPLES
    if resumed_at is None or not path.exists():
        return
    kept = []
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:  # a damaged line (not JSON, not an object, no whole-number step) is dropped, never a traceback
            row = json.loads(line)
        except ValueError:
            continue
        step = row.get("step", 0) if isinstance(row, dict) else None
        if isinstance(step, int) and not isinstance(step, bool) and step < resumed_at:
            kept.append(line)
    from composer import files

    files.write_text(path, "".join(x + "\n" for x in kept))  # a temporary file renamed, never through a link


# ------------------------------------------------------------------------------------------ `composer eval`

MODEL_ONLY_SPEC = """name: eval
policy: {{model: {model}}}
data: {{train: {data}, eval: {data}}}
sources: {{verifier: {{kind: outcome_reward}}}}
signal: {{kind: reward, source: verifier}}
objective: {{kind: grpo}}
"""


def _say(line: str) -> None:
    """`composer eval`'s progress: one line on stderr per stage (loading, each tier before and after)."""
    import sys

    sys.stderr.write(line + "\n")
    sys.stderr.flush()


class EvalError(ValueError):
    """`composer eval` cannot evaluate what it was given: the message says why and what to give instead."""


def _target(target: Path) -> tuple[Path | None, Path | None, Path | None]:
    """(run folder, checkpoint, model directory) of a checkpoint file, a run folder or an exported model."""
    if target.is_file():
        run = target.parent.parent if target.parent.name == "checkpoints" else None
        return (run if run is not None and (run / "spec.yaml").exists() else None), target, None
    if target.is_dir() and (target / "spec.yaml").exists():
        ckpt = target / "checkpoints" / "last.ckpt"
        if ckpt.exists():
            return target, ckpt, None
        if (target / "model" / "config.json").exists():
            return target, None, target / "model"
        raise EvalError(f"{target}: the run folder holds no checkpoint (checkpoints/last.ckpt) and no model/")
    if target.is_dir() and (target / "config.json").exists():
        run = target.parent if (target.parent / "spec.yaml").exists() else None
        return run, None, target
    raise EvalError(f"{target}: not a checkpoint, a run folder (spec.yaml) or a model directory (config.json)")


def _validate_text(text: str, overrides: list[str]):
    import tempfile

    from composer.checks.validate import validate_file

    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        f.write(text)
    try:
        return validate_file(f.name, overrides)
    finally:
        Path(f.name).unlink(missing_ok=True)


def _spec(run: Path | None, ckpt: Path | None, model_dir: Path | None, data: str | None, overrides: list[str]):
    """The validated spec to evaluate with: the run's spec.yaml, else the spec a checkpoint records, else (a
    model directory alone) a spec of the model, `data` and the math verifier."""
    import json

    from composer.checks.validate import validate_file

    if run is not None:
        return validate_file(run / "spec.yaml", overrides)
    if ckpt is not None:
        from composer.runtime import checkpoint as ckpt_format

        composer = ckpt_format.load(ckpt, mmap=True).get("composer")
        record = composer.get("spec") if isinstance(composer, dict) else None
        try:
            resolved = json.loads(record["json"]) if isinstance(record, dict) else None
        except (KeyError, TypeError, ValueError):
            resolved = None
        if not isinstance(resolved, dict):
            raise EvalError(f"{ckpt}: the checkpoint does not record its spec (or the record is damaged); evaluate "
                            "its run folder instead")
        for key in ("phases", "stages", "extends"):  # the checkpoint records the resolved base spec
            if not resolved.get(key):
                resolved.pop(key, None)
        return _validate_text(json.dumps(resolved), overrides)
    if data is None:
        raise EvalError(f"{model_dir}: a model directory outside a run folder needs --data FILE{data_hint(model_dir)}")
    return _validate_text(model_only_spec(model_dir, data), overrides)


def data_hint(model_dir: Path) -> str:
    """What else `composer eval MODEL_DIR --data D` needs: nothing for an export that keeps its run's settings
    (composer_export.json: the fields are read from there), the rows' fields as overrides for another model."""
    from composer.runtime.export import export_settings

    run = export_settings(model_dir)
    if not run:
        return " (and the rows' fields as overrides, e.g. data.prompt_field=problem)"
    kept = [f"data.{k}" for k, v in (run.get("data") or {}).items() if v is not None] + \
        (["the verifier"] if run.get("verifier") else [])
    return (f"; the rest comes from the export's composer_export.json ({', '.join(kept) or 'the defaults'}, the "
            "evaluation sizes)")


def export_step(model_dir: Path) -> int:
    """The optimizer steps an export's weights had taken (composer_export.json `step`), 0 when it does not say."""
    from composer.runtime.export import export_settings

    step = export_settings(model_dir).get("step")
    return step if isinstance(step, int) and not isinstance(step, bool) and step >= 0 else 0


def model_only_spec(model_dir: Path, data: str) -> str:
    """The spec `composer eval MODEL_DIR --data D` evaluates with: an export's run settings (its prompt and data
    fields, verifier, evaluation sizes: composer_export.json), else the defaults and the math verifier."""
    import json

    from composer.runtime.export import export_settings

    run = export_settings(model_dir)
    if not run:
        return MODEL_ONLY_SPEC.format(model=json.dumps(str(model_dir)), data=json.dumps(str(data)))
    source = {"kind": "outcome_reward", **({"verifier": run["verifier"]} if isinstance(run.get("verifier"), str) else {})}
    spec = {"name": "eval", "policy": {"model": str(model_dir)},
            "data": {**(run.get("data") if isinstance(run.get("data"), dict) else {}), "train": str(data), "eval": str(data)},
            "sources": {"verifier": source}, "signal": {"kind": "reward", "source": "verifier"},
            "objective": {"kind": "grpo"}}
    for key in ("train", "rollout"):
        if isinstance(run.get(key), dict) and run[key]:
            spec[key] = dict(run[key])
    return json.dumps(spec)


EVAL_FILES = ("eval.json", EVAL_SAMPLES)


def out_problem(out: Path) -> str | None:
    """Why `composer eval --out` may not write into `out` (None: new, empty, or an earlier `composer eval`'s
    folder, whose two files are replaced). A run folder, or a folder with anything else in it, is refused: its
    eval_samples.jsonl and other files are not this command's to overwrite."""
    if out.is_symlink():
        return "it is a symbolic link; give the real folder"
    if not out.exists():
        return None
    if not out.is_dir():
        return "it is a file, not a folder"
    names = {p.name for p in out.iterdir()}
    if not names:
        return None
    mine = False
    try:
        found = json.loads((out / "eval.json").read_text(encoding="utf-8"))
        mine = isinstance(found, dict) and {"target", "weights", "metrics"} <= set(found)
    except (OSError, ValueError):
        pass
    if mine and names <= set(EVAL_FILES) and not any((out / n).is_symlink() for n in names):
        return None
    return (f"the folder holds files `composer eval` did not write ({', '.join(sorted(names - set(EVAL_FILES)) or sorted(names))[:200]}); "
            "nothing is overwritten\n    hint: choose a new or empty folder (default: eval/ in the run folder)")


def evaluate_target(target, data: str | None = None, k: int | None = None, out=None,
                    overrides: list[str] | None = None) -> tuple[dict, Path]:
    """Evaluate a checkpoint, a run folder (its last checkpoint) or an exported model directory alone, as a run's
    evaluation does: the run's spec (eval data, verifier, eval_samples, eval_k), `data` as the eval file and
    `k` as train.eval_k when given. Writes eval.json and eval_samples.jsonl to `out` (default: the run
    folder's eval/, else eval/ beside the model). Returns (metrics, the output folder)."""
    import json
    import time

    from composer import files
    from composer.runtime import checkpoint as ckpt_format
    from composer.runtime.binding import bind_task
    from composer.runtime.context import RunContext
    from composer.runtime.models import load_model, load_tokenizer, prepare_policy

    target = Path(target)
    if out is not None:
        why = out_problem(Path(out))
        if why:
            raise EvalError(f"--out {out}: {why}")
    run, ckpt, model_dir = _target(target)
    over = list(overrides or []) + ([f"data.eval={data}"] if data is not None and (run or ckpt) else []) + \
        ([f"train.eval_k={k}"] if k is not None else [])
    v = _spec(run, ckpt, model_dir, data, over)
    spec = v.segments[-1].spec if getattr(v, "segments", None) else v.spec
    if data is not None and spec.data.train is None:
        raise EvalError(f"--data {data}: this run trained on the toy testbed, whose prompts its model was trained "
                        "to read; --data is for runs on data files and exported models")
    if spec.data.train is not None and spec.data.eval is None and not spec.data.eval_split:
        raise EvalError("the spec has no data.eval: give --data FILE")
    if spec.data.train is not None and spec.data.eval is not None:  # only the eval rows are read (the training
        from composer.runtime.datafiles import SourceError, choose_split, splits  # file may be gone)

        try:  # the eval source stands in for train: with the split evaluation reads
            split = choose_split(spec.data.eval, splits(spec.data.eval), spec.data.eval_split, "eval")
        except SourceError as e:
            raise EvalError(str(e)) from None
        spec = spec.model_copy(update={"data": spec.data.model_copy(update={"train": spec.data.eval, "split": split})})
    task = bind_task(spec)
    trust = spec.policy.trust_remote_code
    _say(f"eval: {target} ({'the model directory' if model_dir is not None else 'its checkpoint'}), "
         f"verifier {eval_verifier(SimpleNamespace(spec=spec, task=task))}, "
         f"{sum(len(eval_examples(SimpleNamespace(spec=spec), x)) for x in task.eval.values())} problem(s) in "
         f"{len(task.eval)} tier(s); loading the model ...")
    step = 0
    if model_dir is not None:
        step = export_step(model_dir)
        policy = load_model(str(model_dir), spec.policy.dtype, trust_remote_code=trust)
        tokenizer = load_tokenizer(str(model_dir), trust_remote_code=trust)
        weights = str(model_dir)
    else:
        name = spec.policy.model or "toy:student"
        tokenizer = load_tokenizer(spec.policy.tokenizer or name, trust_remote_code=trust)
        policy = prepare_policy(load_model(name, spec.policy.dtype, trust_remote_code=trust), spec.policy)
        state = ckpt_format.load(ckpt)
        step = state.get("global_step", 0)
        if not isinstance(state.get("state_dict"), dict) or not isinstance(step, int) or isinstance(step, bool) \
                or step < 0:
            raise EvalError(f"{ckpt}: the checkpoint is damaged (its state_dict or global_step is not what a run "
                            "writes)\n    hint: restore the run's own checkpoints/last.ckpt, or evaluate its model/")
        sd = {key[len("policy."):]: t for key, t in state["state_dict"].items()
              if isinstance(key, str) and key.startswith("policy.")}
        try:
            policy.load_state_dict(sd)
        except Exception as e:  # weights of another model, or not tensors
            first = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
            raise EvalError(f"{ckpt}: its weights do not fit the policy the spec names ({type(e).__name__}: "
                            f"{first})") from None
        weights = str(ckpt)
    policy.eval()
    ctx = RunContext(task=task, tokenizer=tokenizer, policy=policy, engine=None, spec=spec, seed=spec.train.seed,
                     step=max(step - 1, 0))  # the run's final evaluation samples with the last step's seed
    records: list = []
    metrics = evaluate(ctx, policy, records, progress=_say)
    if out is None:
        base = (run or (model_dir.parent if model_dir is not None else target.parent)) / "eval"
        out, n = base, 1
        while out.exists():
            n += 1
            out = base.with_name(f"eval-{n}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / EVAL_SAMPLES).unlink(missing_ok=True)  # an earlier `composer eval`'s (out_problem): replaced, not appended
    write_records(out, step, records)
    files.write_text(out / "eval.json", json.dumps({
        "target": str(target), "weights": weights, "step": step, "data": spec.data.eval or "toy testbed",
        "verifier": eval_verifier(ctx), "eval_samples": spec.train.eval_samples, "eval_k": spec.train.eval_k,
        "time": time.strftime("%Y-%m-%d %H:%M:%S"), "metrics": metrics}, indent=2))
    return metrics, out
