"""From a validated spec to OpenRLHF runs: native flags for everything they express, the plugin for the rest.

One run per stage (stages are separate OpenRLHF launches; a later stage starts from the earlier one's
model), or one run for the whole spec when it has phases (the plugin switches guide and objective by
the trainer's step). Decisions read component kinds and fields, never method names. Anything OpenRLHF
cannot express raises Unsupported naming the component and the reason.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from composer.capabilities import departures, needs
from composer.gates import gate_source
from composer.checks.graph import signal_objective_pairs
from composer.checks.terms import gates
from composer.lang.curves import is_scheduled

NATIVE_AGG = ("token-mean", "seq-mean-token-mean")  # --actor.loss_agg_mode choices


class Unsupported(Exception):
    """A spec OpenRLHF cannot express: `path` names the component, `reason` says why."""

    def __init__(self, path: tuple, reason: str, hint: str = ""):
        super().__init__(reason)
        self.path, self.reason, self.hint = tuple(path), reason, hint


# What OpenRLHF 0.11.2 cannot run, per backend feature a spec's parts may declare they need (composer/capabilities.py):
# (why, the fix). `check_capabilities` derives the refusals from the parts' own records.
LACKS = {
    "sequences_not_sampled": ("OpenRLHF trains on the samples its vLLM engines draw from the policy; sequences from a "
                              "dataset or another model (GKD's off-policy branch) are not samples of the step",
                              "train it on the Lightning backend"),
    "step_token_mask": ("the token selection is a statistic of the whole step's tokens (Cov_t, or the old policy's "
                        "entropy H_t from a forward with the full logits at the step's start, over every micro-batch "
                        "and rank), and the bundle's plugin carries the advantage step's results to the loss only as "
                        "per-sample values in Experience.info, which OpenRLHF splits and re-pads by row; a per-token "
                        "mask has no carrier there, and computing it per micro-batch (as verl does) would change the "
                        "method", "train it on the lightning backend, or set token_selection: {kind: none}"),
    "rollout_reuse": ("OpenRLHF samples new rollouts every step; it cannot train between syncs on the rollouts of the "
                      "last sync", "set sync.reuse: false"),
    "capped_refill": ("OpenRLHF's dynamic filtering replaces a dropped prompt until the data runs out: it has no cap "
                      "on extra sampling rounds", "set rollout.filter.max_rounds: null to accept the uncapped refill"),
    "row_drop": ("OpenRLHF trains on every sample of a step (the composer's loss can mask a row, not remove it before "
                 "advantages)", "use truncated: mask"),
    "separate_tokenizer": ("OpenRLHF loads the tokenizer from the model directory",
                           "drop policy.tokenizer, or save the tokenizer into the model directory"),
    "periodic_reset": ("OpenRLHF's trainer has no point inside a run where the reference model's weights and the "
                       "DeepSpeed optimizer state can be replaced, so a periodic reset cannot be expressed",
                       "write one stage per reset (each stage starts a fresh optimizer and, with train.reference: "
                       "stage_start, a fresh reference), or use the lightning backend"),
    "sampled_eval": ("the bundle's evaluation is greedy (an RL run's pass@1 through the reward function, an SFT "
                     "run's loss on the reference solutions); pass@k from sampled answers runs on the Lightning "
                     "backend",
                     "set train.eval_k: 0, and evaluate the exported model with `composer eval MODEL --k N`"),
    "scheduled_entropy": ("OpenRLHF's entropy bonus is its own flag (--actor.entropy_coef), one number for the run; it "
                          "has no schedule", "use a number on the openrlhf backend, or train on lightning"),
    "coupled_rows": ("the term's loss couples two rollouts of a group (a DPO pair: -log sigmoid(beta (s_w - s_l))). "
                     "OpenRLHF's PPO trainer has no pairwise loss, and the composer's loss in the bundle's plugin sees "
                     "the micro-batches OpenRLHF's replay buffer draws by shuffled rows, across ranks: a pair's two "
                     "rows land in different micro-batches, so the pair's loss cannot be computed there",
                     "train it on the lightning backend (its mini-batches and DDP ranks hold whole groups)"),
}


@dataclass
class Layout:
    """The cluster the bundle is for (CLI options)."""

    nodes: int = 1
    gpus_per_node: int = 8
    colocate: bool = True
    vllm_engines: int | None = None  # without colocation: engines (default 1); with it: nodes*gpus/TP
    cluster_dir: str = "/tmp/composer-runs"  # checkpoints, final models and logs, on the cluster
    wandb_project: str | None = None


@dataclass
class Inputs:
    """What the bundle resolved before the flags: model paths and the data files it wrote."""

    policy_path: str
    source_paths: dict[str, str]  # policy_model source name -> resolved model path ('self' for the policy)
    train_file: str  # relative to the bundle
    train_rows: dict[str, int]  # run name -> rows written for it
    eval_file: str | None  # data/eval.jsonl: prompt, label, datasource and, when the rows have one, target
    max_prompt_chars: int
    max_solution_chars: int
    sft_eos: str | None = None  # eos text appended to SFT targets (None: OpenRLHF appends " " + eos)
    toy: bool = True
    max_problem_chars: int = 0  # the {problem} a judge prompt shows (0: bounded by max_prompt_chars)
    prompt_format: str = ""  # how the prompts in the data were rendered (data: chat template / plain; "" toy)
    prompt_overhead_chars: int = 0  # what rendering adds around a user message (chat turns, system prompt)
    prompt_example: str = ""  # the first training prompt as written into the data
    prompt_note: str | None = None  # a problem with the rendered prompts worth a note in the README
    critic_paths: dict[str, str] = field(default_factory=dict)  # "critic" -> a ppo critic's own checkpoint, resolved
    eval_targets: bool = False  # every eval row has a reference solution (`target`: what train_sft evaluates on)
    conversations: str | None = None  # messages rows: "native" (train_sft's multiturn trains exactly their assistant
    # turns, the rows are written as `messages`), else why it does not (bundle.py `conversation_mapping`)
    max_conversation_chars: int = 0  # the longest conversation as the chat template renders it


@dataclass
class Run:
    name: str
    trainer: str  # "ppo" | "sft"
    segments: list[int]  # indices into plan["segments"]
    argv: list[str] = field(default_factory=list)
    plugin: dict[str, Any] = field(default_factory=dict)  # what the plugin installs (read by the workers)
    native: list[str] = field(default_factory=list)  # human-readable: what OpenRLHF flags express
    via_plugin: list[str] = field(default_factory=list)  # human-readable: what the plugin does
    notes: list[str] = field(default_factory=list)
    output_dir: str = ""
    nproc: int = 1  # SFT: processes on the node


def _terms(spec):
    weights = [t.weight for t in spec.terms] if spec.terms else [1.0]
    base = [("terms", i) for i in range(len(spec.terms))] if spec.terms else [()]
    return [(b, s, o, w) for b, (s, o), w in zip(base, signal_objective_pairs(spec), weights)]


def _is_reference_sft(sig, obj) -> bool:
    """Fixed demonstrations trained by train_sft: the signal's and the objective's own mappings say so."""
    return sig.openrlhf_trainer() == "sft" and obj.openrlhf_sft()


def _native_grpo(spec) -> bool:
    """One reward term whose objective maps whole onto OpenRLHF's own PolicyLoss (its `openrlhf_native()` lists
    nothing: every field it does not carry is at its default), under plain sampling. Anything else runs the
    composer's own loss in the plugin, never a silent drop. OpenRLHF's group_norm groups rows by prompt only, so a
    guide (whose rows may carry a tag that splits a prompt's rows into advantage groups, the Plan's
    `groups: prompt x guide tag`) takes the composer's loss."""
    return not native_blockers(spec)


def native_blockers(spec) -> list[str]:
    """Why the segment `spec` does not run on OpenRLHF's own PolicyLoss ([]: it does), in words, for the bundle's
    README: the objective's own mapping (`openrlhf_native`) and what the step around it declares."""
    terms = _terms(spec)
    if len(terms) != 1:
        return [f"{len(terms)} terms (OpenRLHF's PolicyLoss trains one)"]
    _, sig, obj, w = terms[0]
    out = list(obj.openrlhf_native())
    if sig.openrlhf_trainer() != "ppo":
        out.append(f"signal {sig.kind_name()} (OpenRLHF's PolicyLoss trains on the reward)")
    if w != 1.0:
        out.append(f"term weight {w}")
    if not type(spec.rollout.guide).plain:
        out.append(f"guide {spec.rollout.guide.kind_name()} (its rows may split a prompt's advantage groups)")
    if spec.sync.every != 1:
        out.append(f"sync.every {spec.sync.every}")
    if any(g is not None for g in gates(spec)):
        out.append("a term gate")
    if spec.rollout.filter.truncated != "keep":
        out.append(f"rollout.filter.truncated: {spec.rollout.filter.truncated}")
    return out


BINARY_VERIFIERS = ("toy", "math", "exact")  # rewards in {0, 1}: a mean strictly inside (0, 1) is a mixed group


def _shaping_and_filter_flags(a: _Args, run: Run, spec, terms, where: tuple, inputs) -> None:
    """Reward parts and rollout filters on OpenRLHF's native flags, or Unsupported naming the part and why:
    DAPO's overlong penalty -> --reward.overlong_buffer_len/overlong_penalty_factor (the same formula, applied
    to every sample's reward before the advantage step); equal_groups: drop -> --algo.dynamic_filtering_enable
    with range (0, 1) over the verifier's scores; truncated: mask -> the advantage step's row masks."""
    p = run.plugin
    max_new = spec.rollout.max_new_tokens if not inputs.toy else min(spec.rollout.max_new_tokens, _toy_cap(spec))
    for i, (_n, sig, _o, _w) in enumerate(terms):
        plus = getattr(sig, "plus", None) or {}
        base = where + (("terms", i) if spec.terms else ()) + ("signal", "plus")
        for name, w in plus.items():
            src = spec.sources[name]
            part = src.openrlhf_reward_part(w, max_new)  # the part's own engine mapping (its file)
            if part is None:
                raise Unsupported(base + (name,), f"OpenRLHF carries one reward per sample (reward.py's one verifier); "
                                  f"'{name}' ({src.kind_name()}) would be a second reward", "train it on the Lightning "
                                  "backend, or drop it from `plus`")
            if "refused" in part:
                raise Unsupported(base + (name,), part["refused"], part["hint"])
            if spec.rollout.environment.active:
                raise Unsupported(base + (name,), f"OpenRLHF's length penalties measure a response from its first to "
                                  f"its last action token (the environment's answers between policy turns counted, "
                                  f"one after the last turn not), and the composer's '{name}' counts every response "
                                  f"token of the episode: the two differ on an episode that ends on the environment's "
                                  f"answer", "train it on the lightning backend, or drop it from `plus`")
            if any(g is not None for g in gates(spec)):
                raise Unsupported(base + (name,), "on OpenRLHF a term gate reads success from the sample's reward, "
                                  "which the reward part has already changed", "train it on the Lightning backend")
            for flag, *values in part["flags"]:
                a.add(flag, *values)
            run.native.append(f"reward shaping: {part['note']} = the composer's {src.kind_name()} '{name}'")
    flt = spec.rollout.filter
    if flt.equal_groups == "drop":
        from composer.filters import filter_source

        path = where + ("rollout", "filter")
        if filter_source(flt, spec) != p["reward_source"] or p["verifier"] not in BINARY_VERIFIERS:
            raise Unsupported(path + ("equal_groups",), "OpenRLHF's dynamic filtering keeps a prompt whose mean score "
                              "lies strictly inside (0, 1), which is 'not all equal' only for 0/1 rewards of the "
                              f"run's one verifier ({', '.join(BINARY_VERIFIERS)})", "train it on the Lightning backend")
        a.add("algo.dynamic_filtering_enable")
        a.add("algo.dynamic_filtering_range", 0.0, 1.0)
        run.native.append("dynamic sampling: --algo.dynamic_filtering_enable, range (0, 1): a prompt whose 0/1 "
                          "scores are all equal is replaced by a new one (OpenRLHF logs dynamic_filtering_pass_rate); "
                          f"the prompt pool holds {pool_factor([spec])} x steps x prompts_per_step rows for the "
                          "refills, the run stops at its declared steps and fails naming rollout.filter if the pool "
                          "runs out")
    if flt.truncated == "mask":
        p["mask_truncated"] = True  # _native_grpo is False: the composer's loss reads the row masks



def pool_factor(specs) -> int:
    """How many times steps x prompts_per_step the run's prompt pool holds. OpenRLHF's dynamic filtering
    replaces every dropped prompt with the loader's next one, from the same pool the steps draw from, with no
    cap: a pool of exactly steps x prompts runs out before the last steps (the loop then ends quietly). With
    equal_groups: drop the pool holds 1 + R rows per declared prompt, R the filter's default round cap (the
    Lightning backend's refill budget per step); the run stops at its declared steps (hooks: generate_samples)
    and fails naming the filter if the pool still runs out."""
    from composer.filters import RolloutFilter

    if not any(s.rollout.filter.equal_groups == "drop" for s in specs):
        return 1
    return 1 + int(RolloutFilter.model_fields["max_rounds"].default)


def _native_estimator(obj) -> str | None:
    """OpenRLHF's --algo.advantage.estimator that computes the same advantages as the grpo's estimator, or None
    (then the composer's own estimator runs in the plugin): group_norm (std by group), dr_grpo (no std), rloo.
    reinforce_baseline normalises over tokens (the composer's over rows), and a std over the batch has no flag."""
    return obj.est.native_flag()  # declared by the estimator: no kind is checked here


def _updates(specs, where, native: bool) -> str:
    """train.epochs / train.mini_batches as OpenRLHF's --train.max_epochs and --train.batch_size (rollouts /
    mini_batches). Epochs run on both losses: OpenRLHF's own PolicyLoss and the composer's loss in the plugin both
    take the actor's log-prob of the make-experience step (`old`) as the ratio's denominator. Mini-batches only
    with OpenRLHF's own loss: the plugin scales every micro-batch by the whole step's normaliser (exact for one
    optimizer step per pass), and OpenRLHF's mini-batches are shuffled rows, not whole groups."""
    many = [s.train for s in specs if s.train.epochs * s.train.mini_batches > 1]
    if not many:
        return ""
    w, t = where, many[0]
    if len({(s.train.epochs, s.train.mini_batches) for s in specs}) > 1:
        raise Unsupported(w + ("train", "epochs"), "OpenRLHF takes one --train.max_epochs and --train.batch_size "
                          "for a run; these phases change them", "keep epochs and mini_batches the same in every phase")
    if t.mini_batches > 1 and not native:
        raise Unsupported(w + ("train", "mini_batches"),
                          "mini-batches run only with OpenRLHF's own PolicyLoss (a native grpo): the composer's loss "
                          "in the plugin scales every micro-batch by the whole step's normaliser, which is exact for "
                          "one optimizer step per pass, and OpenRLHF's mini-batches are shuffled rows, not whole groups",
                          "set train.mini_batches: 1 on openrlhf (train.epochs works), or train on lightning")
    return (f"{t.epochs} epoch(s) x {t.mini_batches} mini-batch(es) per rollout batch: --train.max_epochs "
            f"{t.epochs}, --train.batch_size = rollouts / {t.mini_batches}; the ratio's denominator is the actor's "
            "log-prob of the make-experience step (old)" + ("; OpenRLHF's mini-batches are shuffled rows (the "
                                                             "composer's on lightning: whole groups in order)"
                                                             if t.mini_batches > 1 else ""))


def _divisor_at_most(n: int, cap: int) -> int:
    return max(d for d in range(1, min(n, cap) + 1) if n % d == 0)


def _fmt(x) -> str:
    return repr(float(x)) if isinstance(x, float) else str(x)


class _Args:
    def __init__(self):
        self.argv: list[str] = []

    def add(self, flag: str, *values) -> None:
        self.argv.append(f"--{flag}")
        self.argv += [_fmt(v) for v in values]


def build_runs(v, layout: Layout, inputs: Inputs) -> list[Run]:
    """The OpenRLHF runs of a validated spec (one per stage, else one)."""
    segs = v.segments
    groups = [[i] for i in range(len(segs))] if v.spec.stages else [list(range(len(segs)))]
    runs, model = [], inputs.policy_path
    for group in groups:
        name = segs[group[0]].name if v.spec.stages else "main"
        run = _run(name, group, [segs[i] for i in group], layout, inputs, model)
        runs.append(run)
        model = f"{run.output_dir}/model"  # the next stage starts from this one's final model
    return runs


def check_capabilities(spec, where: tuple) -> None:
    """Refuse the first part of a resolved spec whose capabilities need a feature OpenRLHF lacks (`LACKS`): what a
    component or a spec section declares it relies on (composer/capabilities.py), never a kind listed here."""
    for path, need in needs(spec):
        if need.feature in LACKS:
            reason, hint = LACKS[need.feature]
            raise Unsupported(where + path, reason, hint)


def _check_optimizer(spec, where: tuple, later_stage: bool) -> None:
    """The optimizer state a stage starts with must mean the same on both backends (issue 46)."""
    if later_stage and spec.train.optimizer_at_stage == "keep":
        raise Unsupported(where + ("train", "optimizer_at_stage"), "OpenRLHF launches each stage as a new run that "
                          "loads the previous stage's final model, not its DeepSpeed optimizer state, so the AdamW "
                          "moments cannot be kept across the stage boundary",
                          "use train.optimizer_at_stage: reset (the default, the same on both backends), or the "
                          "lightning backend")


def _freezing_steps(run: Run, segs) -> None:
    """train.freeze_policy (a critic-only segment, VAPO's value pre-training) as OpenRLHF's --critic.freezing_steps:
    its trainer skips the actor's fit while global_step <= freezing_steps (global_step counts from 0), so the frozen
    phases must be the run's first ones, K steps in all -> K - 1. Its critic and actor each run their own LR
    scheduler over their own updates; the composer's LR program restarts at each phase: equal only without warm-up
    or decay."""
    frozen = [s.spec.train.freeze_policy for s in segs]
    if not any(frozen):
        return
    k = frozen.index(False) if False in frozen else len(frozen)
    if any(frozen[k:]):
        seg = segs[k + frozen[k:].index(True)]
        raise Unsupported(tuple(seg.origin) + ("train", "freeze_policy"), "OpenRLHF freezes the actor only for the "
                          "first steps of a run (--critic.freezing_steps): this segment comes after one that trains "
                          "the policy", "freeze the policy in the first phases only, or train on the lightning backend")
    for seg in segs:
        t = seg.spec.train
        if t.warmup_steps or t.lr_schedule != "constant":
            raise Unsupported(tuple(seg.origin) + ("train", "warmup_steps" if t.warmup_steps else "lr_schedule"),
                              "with train.freeze_policy the composer's LR program restarts at the phase that trains "
                              "the policy, while OpenRLHF's actor and critic schedulers each count their own updates "
                              "over the run", "use a constant LR without warm-up, or train on the lightning backend")
    steps = segs[k - 1].end - segs[0].start
    run.argv += ["--critic.freezing_steps", str(steps - 1)]
    run.native.append(f"train.freeze_policy: the actor frozen for the run's first {steps} step(s), the critic trains "
                      f"alone (--critic.freezing_steps {steps - 1}: OpenRLHF skips the actor while global_step <= it, "
                      "counting from 0)")


def _run(name, group, segs, layout: Layout, inputs: Inputs, model: str) -> Run:
    specs = [s.spec for s in segs]
    where = [tuple(s.origin) for s in segs]
    for spec, w in zip(specs, where):
        check_capabilities(spec, w)
        _check_optimizer(spec, w, later_stage=model != inputs.policy_path)
    run = Run(name, "ppo", group, output_dir=f"{layout.cluster_dir.rstrip('/')}/{name}")
    pairs = [(w, t) for spec, w in zip(specs, where) for t in _terms(spec)]
    ref_sft = [_is_reference_sft(s, o) for _, (_, s, o, _) in pairs]
    if any(ref_sft) and not all(ref_sft):
        w, (b, _, _, _) = pairs[ref_sft.index(True)]
        spec_of = [spec for spec, ww in zip(specs, where) for _t in _terms(spec)][ref_sft.index(True)]
        if b and spec_of.terms[b[-1]].gate is not None:  # HPT: the gate reads the same step's rollouts
            raise Unsupported(w + b + ("signal",), "an SFT term on reference demonstrations runs through train_sft, "
                              "which cannot be mixed with rollout terms in one OpenRLHF run, and its gate reads the "
                              "rollouts of the same step, so stages cannot split them", "train it on the Lightning backend")
        raise Unsupported(w + b + ("signal",), "an SFT term on reference demonstrations runs through train_sft, "
                          "which cannot be mixed with rollout terms in one OpenRLHF run",
                          "to learn from the demonstrations inside the RL run, put them into the groups as traces "
                          "(rollout.guide: {kind: traces, source: <reference_solution source>}, loss_tokens: [policy, "
                          "demonstration] and off_policy_weight: {kind: shaped} on grpo; LUFFY, "
                          "specs/methods/luffy.yaml), which OpenRLHF runs; or train on the Lightning backend; "
                          "`stages` (SFT first, then RL) is another method")
    if all(ref_sft):
        run.trainer = "sft"
    for w, (b, sig, _o, _w) in pairs:  # one actor temperature per training step
        spec = specs[where.index(w)]
        temps = {t.loss_temperature if t.loss_temperature is not None else spec.rollout.temperature
                 for _, t, _, _ in _terms(spec) if t is not None}
        if len(temps) > 1:
            raise Unsupported(w + b + ("signal",), "its terms read the policy's log-probs at different temperatures "
                              f"({', '.join(f'{t:g}' for t in sorted(temps))}), and OpenRLHF's actor computes one "
                              "forward per step at one temperature", "make the temperatures equal, or use `stages`")
    args = [_Args() for _ in specs]
    for a, spec, w in zip(args, specs, where):
        (_sft_flags if run.trainer == "sft" else _ppo_flags)(a, run, spec, specs, w, layout, inputs, model)
    for a, seg in zip(args[1:], segs[1:]):  # launch flags cannot change between phases of one run
        first, this = _flag_values(args[0].argv), _flag_values(a.argv)
        diff = sorted(f for f in set(first) | set(this) if first.get(f) != this.get(f))
        if diff:
            raise Unsupported(tuple(seg.origin), f"phase '{seg.name}' changes OpenRLHF launch flags "
                              f"({', '.join(diff)}), which are fixed for a run",
                              "keep these settings equal across phases, or use `stages`")
    run.argv = args[0].argv
    _freezing_steps(run, segs)
    run.native.append("optimizer state: fresh AdamW at this run's start" + (
        " (this stage is a new OpenRLHF run: train.optimizer_at_stage reset)" if model != inputs.policy_path else ""))
    _check_initial_calls(segs, specs, where)
    if len(segs) > 1:
        run.via_plugin.append("phases: " + ", ".join(f"{s.name} = steps {s.start}-{s.end}" for s in segs)
                              + ", switched by the trainer's step (carried to the rollout workers in the label)")
    run.native = list(dict.fromkeys(run.native))
    run.via_plugin = list(dict.fromkeys(run.via_plugin))
    run.notes = list(dict.fromkeys(run.notes))
    return run


def _check_initial_calls(segs, specs, where) -> None:
    """A guide's calls that read the frozen initial weights are served by the rollout engine (agent.py), which
    holds them only until the run's first broadcast (the Plan's `Schedule.sampler_is_initial`): a segment
    that starts after it cannot have them."""
    from composer.plan.schedule import Schedule, compile_schedule
    from composer.plan.compile import _models

    sched = Schedule(compile_schedule(segs, _models))
    for seg, spec, w in zip(segs, specs, where):
        guide = spec.rollout.guide
        reads = [c for c, wts in guide.reads().items() if wts == "initial"]
        reads += [f"judge '{c.source}'" for c in guide.model_calls(spec) if c.weights == "initial"]
        if reads and seg is not segs[0] and not sched.sampler_is_initial(seg.start):  # a run's first segment: its
            # engine starts from the run's model (a later stage's run: the stage's start, its initial weights)
            raise Unsupported(w + ("rollout", "guide"), f"{', '.join(reads)} of segment '{seg.name}' read the frozen "
                              f"initial weights, but on OpenRLHF only the rollout engine serves them, and from step "
                              f"{seg.start} on it holds the weights after step {sched.sampler_version(seg.start)}",
                              "switch this guide on in the run's first segment, or start a `stage` for it "
                              "(train.reference: stage_start)")


def _flag_values(argv: list[str]) -> dict[str, tuple]:
    out, flag = {}, None
    for x in argv:
        if x.startswith("--"):
            flag = x
            out[flag] = ()
        else:
            out[flag] += (x,)
    return out


def _common(a: _Args, run: Run, spec, layout: Layout, prefix: str) -> None:
    t = spec.train
    steps = t.steps
    sched = "cosine" if t.lr_schedule == "cosine" else "constant_with_warmup"
    a.add(f"{prefix}adam.lr", t.lr)
    a.add(f"{prefix}adam.betas", *[float(b) for b in t.betas])
    a.add(f"{prefix}adam.weight_decay", t.weight_decay)
    a.add(f"{prefix}lr_scheduler", sched)
    a.add(f"{prefix}lr_warmup_ratio", t.warmup_steps / steps)
    a.add(f"{prefix}max_norm", t.grad_clip)
    a.add("train.seed", t.seed)
    a.add("ds.param_dtype", "fp16" if spec.policy.dtype == "float16" else "bf16")
    a.add("ckpt.path", f"{run.output_dir}/ckpt")
    a.add("ckpt.save_steps", t.checkpoint_every)
    a.add("ckpt.output_dir", f"{run.output_dir}/model")
    a.add("ckpt.load_enable")
    a.add("logger.logging_steps", 1)
    a.add("logger.tensorboard_dir", f"{run.output_dir}/tensorboard")
    if layout.wandb_project:
        a.add("logger.wandb.key", "env:WANDB_API_KEY")
        a.add("logger.wandb.project", layout.wandb_project)
        a.add("logger.wandb.run_name", run.name)
    run.native += [f"optimizer: AdamW lr {t.lr}, betas {tuple(t.betas)}, weight decay {t.weight_decay}, "
                   f"{sched} schedule, grad clip {t.grad_clip}",
                   f"checkpoints every {t.checkpoint_every} steps, final model, TensorBoard"
                   + (" and W&B" if layout.wandb_project else "") + " logs under " + run.output_dir]
    if t.compile:
        run.notes.append("train.compile applies to the Lightning backend; OpenRLHF's trainer runs uncompiled")
    if spec.policy.dtype == "float32":
        run.notes.append("policy.dtype float32 trains in bf16 on OpenRLHF (DeepSpeed + vLLM have no fp32 mode)")


def _sft_flags(a: _Args, run, spec, specs, where, layout: Layout, inputs: Inputs, model: str) -> None:
    (base, sig, obj, _), = _terms(spec)
    for part, name, carried in ((sig, "signal", ("kind", "target")), (obj, "objective", ("kind", "loss_tokens", "aggregation"))):
        extra = [f for f in departures(part) if f not in carried]
        if extra:  # the mapping onto train_sft is complete or absent: no field it cannot carry is dropped
            raise Unsupported(where + base + (name, extra[0]), f"train_sft has no flag for {name}.{extra[0]} "
                              f"(= {getattr(part, extra[0])!r}; it carries the target, the loss tokens and the "
                              "token-mean aggregation)", f"leave {name}.{extra[0]} at its default for this stage on "
                              "openrlhf, or train on lightning")
    if obj.loss_tokens != ["demonstration"]:
        raise Unsupported(where + ("objective", "loss_tokens"), "train_sft trains the demonstration (response) "
                          "tokens only", "use loss_tokens: [demonstration]")
    if obj.aggregation != "token-mean":
        raise Unsupported(where + ("objective", "aggregation"), "train_sft's loss is a token mean",
                          "use aggregation: token-mean")
    if spec.train.epochs * spec.train.mini_batches > 1:
        raise Unsupported(where + ("train", "epochs" if spec.train.epochs > 1 else "mini_batches"), "train_sft takes "
                          "one optimizer step per batch of demonstrations (its max_epochs are passes over the dataset)",
                          "set train.epochs: 1 and train.mini_batches: 1 for this stage on openrlhf")
    if is_scheduled(spec.train.entropy_coef) or any(is_scheduled(w) for *_, w in _terms(spec)):
        raise Unsupported(where + ("train",), "train_sft has no schedule of coefficients", "use numbers")
    if layout.nodes != 1:
        raise Unsupported(("train",), "train_sft is launched with torchrun on the head node: one node only",
                          "compile with --nodes 1")
    n = inputs.train_rows[run.name]
    pps = spec.train.prompts_per_step
    gpus = layout.gpus_per_node
    if pps % gpus:
        raise Unsupported(("train", "prompts_per_step"), f"{pps} demonstrations per step do not split over {gpus} GPUs",
                          f"use a multiple of {gpus}")
    if inputs.conversations not in (None, "native"):  # messages rows train_sft would not train exactly
        raise Unsupported(("data", "train"), "messages rows (conversations): OpenRLHF's multiturn SFT (--data.multiturn)"
                          f" would not train exactly their assistant turns: {inputs.conversations}",
                          "train this spec on lightning (`composer run`), which trains each assistant turn through "
                          "its end of turn and nothing else")
    run.nproc = gpus
    a.add("model.model_name_or_path", model)
    a.add("data.dataset", inputs.train_file)
    if inputs.conversations == "native":  # OpenRLHF's own multiturn SFT: it renders and masks the turns itself
        a.add("data.input_key", "messages")
        a.add("data.apply_chat_template")
        a.add("data.multiturn")
    else:
        a.add("data.input_key", "prompt")
        a.add("data.output_key", "target")
        a.add("data.input_template", "{}")
    a.add("data.max_samples", n)
    a.add("data.max_len", (inputs.max_conversation_chars if inputs.conversations else
                           inputs.max_prompt_chars + inputs.max_solution_chars) + 8)
    a.add("train.batch_size", pps)
    a.add("train.micro_batch_size", _divisor_at_most(pps // gpus, spec.train.micro_batch_size))
    a.add("train.max_epochs", 1)
    _common(a, run, spec, layout, "")
    _sft_eval_flags(a, run, spec, where, inputs)
    if inputs.conversations == "native":
        run.native += [(f"SFT on conversations (token-mean cross-entropy on every assistant turn through its end of "
                        f"turn, the other turns masked) through openrlhf.cli.train_sft --data.multiturn on {gpus} "
                        f"GPU(s), {pps} conversations per step, {spec.train.steps} steps"),
                       (f"data field: messages of {inputs.train_file}, {n} rows, rendered by OpenRLHF with the "
                        "policy tokenizer's chat template (--data.apply_chat_template); checked at compile time to "
                        "train the same tokens as the composer on every row written")]
    else:
        run.native += [(f"SFT (token-mean cross-entropy on the demonstrations, prompt tokens masked) through "
                        f"openrlhf.cli.train_sft on {gpus} GPU(s), {pps} demonstrations per step, {spec.train.steps} "
                        "steps"),
                       f"data fields: prompt and target (the reference solution) of {inputs.train_file}, {n} rows",
                       _prompt_line(inputs)]
    if inputs.sft_eos is None and not inputs.conversations:
        run.notes.append("the tokenizer was not readable at compile time: OpenRLHF appends ' ' + eos to each target")


def _sft_eval_flags(a: _Args, run: Run, spec, where, inputs: Inputs) -> None:
    """train_sft's evaluation (--eval.dataset, --eval.steps): the token-mean loss on the eval rows' reference
    solutions (`eval gpt_loss` in its logs) every train.eval_every steps (0: once, after the run's steps), on the
    first train.eval_samples rows of each tier, as the Lightning backend picks them. It generates no answer, so
    it is no pass@1 (the README says so and names `composer eval` for that) and has no verifier to choose:
    train.eval_verifier is refused rather than ignored. train.eval_k is refused by the capability check
    (sampled_eval)."""
    t = spec.train
    if t.eval_verifier not in (None, "auto"):
        raise Unsupported(where + ("train", "eval_verifier"), "train_sft evaluates the loss on the eval rows' "
                          "reference solutions and generates no answer for a verifier to score",
                          "drop train.eval_verifier for this stage, or evaluate the exported model with `composer "
                          "eval MODEL train.eval_verifier=...`")
    if not inputs.eval_file:
        return
    if not inputs.eval_targets:
        run.notes.append(f"no evaluation during this run: train_sft evaluates the loss on reference solutions, and "
                         f"the rows of {inputs.eval_file} have none (data.solution_field); evaluate the exported "
                         "model with `composer eval`")
        return
    a.add("eval.dataset", inputs.eval_file)
    a.add("eval.steps", t.eval_every or -1)
    when = f"every {t.eval_every} steps" if t.eval_every else "once, after the run's steps"
    run.native.append(f"evaluation: train_sft's loss on the reference solutions of {inputs.eval_file} (the first "
                      f"{t.eval_samples} rows of each tier; `eval gpt_loss` in its logs), {when}; this is no pass@1 "
                      "(train_sft generates nothing): `composer eval MODEL` gives the exported model's greedy pass@1")


def _prompt_line(inputs: Inputs) -> str:
    """How the prompt text reached the data (one README line): OpenRLHF gets it rendered, never re-templated."""
    if inputs.toy or not inputs.prompt_format:
        return "prompts: the toy testbed's own text, as written (no --data.apply_chat_template)"
    return (f"prompts: already rendered by the composer ({inputs.prompt_format}); --data.apply_chat_template is off, "
            "so OpenRLHF tokenizes exactly that text (no special tokens added)")


def _ppo_flags(a: _Args, run: Run, spec, specs, where, layout: Layout, inputs: Inputs, model: str) -> None:
    r, t = spec.rollout, spec.train
    terms = [tt for s in specs for tt in _terms(s)]
    critic = _critic_objective(specs, [where] * len(specs), model != inputs.policy_path)  # PPO with a critic
    native = critic is not None or (all(_native_grpo(s) for s in specs)
                                    and len({repr(_terms(s)[0][2]) for s in specs}) == 1)
    kinds = {o.kind_name() for _, _, o, _ in terms}
    frozen = any(o is not None and o.wants_initial for _, _, o, _ in terms) or any(
        src.wants_initial for src in spec.sources.values())
    if frozen and t.reference == "run_start" and model != inputs.policy_path:
        raise Unsupported(where + ("train", "reference"), "OpenRLHF loads the frozen reference from the stage's starting "
                          "model (the previous stage's output), so it cannot hold the weights of the run's start",
                          "use train.reference: stage_start (the default, the same on both backends)")
    p = run.plugin
    p.update(loss=not native, agent=False, reward_source=None, verifier="none", teachers={}, ref="initial",
             ema_beta=None, sync=any(s.sync.every > 1 for s in specs), top_k=r.top_k)

    # ---- models and GPUs ----
    judges = {c.source: inputs.source_paths[c.source] for s in specs for c in s.rollout.guide.model_calls(s)
              if inputs.source_paths.get(c.source, "self") != "self"}
    p["judges"] = judges  # external judge models: a named vLLM actor each, on a GPU of its own
    n_gpu = layout.nodes * layout.gpus_per_node - len(judges)
    if judges and layout.nodes > 1 and layout.colocate:
        raise Unsupported(("sources", next(iter(judges))), "an external judge takes a GPU of its own, which a "
                          "colocated multi-node layout has not", "compile with --no-colocate")
    if n_gpu < 1:
        raise Unsupported(("sources", next(iter(judges))), "no GPU left for training next to the judge",
                          "add GPUs")
    tp = r.tensor_parallel_size
    if layout.colocate and judges:
        if n_gpu % tp:
            raise Unsupported(("rollout", "tensor_parallel_size"), f"{n_gpu} GPUs (one is the judge's) do not split "
                              f"into vLLM engines of {tp}")
        engines, actor_nodes, actor_gpn = n_gpu // tp, 1, n_gpu
    elif layout.colocate:
        if n_gpu % tp:
            raise Unsupported(("rollout", "tensor_parallel_size"), f"{n_gpu} GPUs do not split into vLLM engines of "
                              f"{tp}", "change --gpus-per-node/--nodes or rollout.tensor_parallel_size")
        engines, actor_nodes, actor_gpn = n_gpu // tp, layout.nodes, layout.gpus_per_node
    else:
        engines = layout.vllm_engines or 1
        left = n_gpu - engines * tp
        if left < 1:
            raise Unsupported(("rollout", "tensor_parallel_size"), f"{engines} vLLM engine(s) of {tp} GPU(s) leave no "
                              f"GPU for training out of {n_gpu}", "add GPUs or colocate (--colocate)")
        actor_nodes, actor_gpn = (left // layout.gpus_per_node, layout.gpus_per_node) \
            if left % layout.gpus_per_node == 0 else (1, left)
        if actor_gpn > layout.gpus_per_node:
            raise Unsupported(("train",), f"{left} training GPUs do not fill whole nodes of {layout.gpus_per_node}",
                              "choose --vllm-engines so the rest fills whole nodes")
    a.add("actor.model_name_or_path", model)
    a.add("actor.num_nodes", actor_nodes)
    a.add("actor.num_gpus_per_node", actor_gpn)
    a.add("ref.num_nodes", actor_nodes)
    a.add("ref.num_gpus_per_node", actor_gpn)
    a.add("vllm.num_engines", engines)
    a.add("vllm.tensor_parallel_size", tp)
    a.add("vllm.gpu_memory_utilization", r.gpu_memory_utilization)
    if layout.colocate:
        a.add("train.colocate_all")
        a.add("vllm.enable_sleep")
        a.add("ds.enable_sleep")
    else:
        a.add("train.colocate_actor_ref")
    run.native.append(f"{actor_nodes}x{actor_gpn} DeepSpeed actor GPU(s), {engines} vLLM engine(s) x TP {tp}"
                      + (", all colocated (sleep mode)" if layout.colocate else ", reference colocated with the actor"))
    for name, path in judges.items():
        run.via_plugin.append(f"judge '{name}': {path} served by a named vLLM actor (composer-judge-{name}) on one "
                              "GPU of its own, started by the entry point; the agent calls it with the judge prompt")
    if r.engine == "hf":
        run.notes.append("rollout.engine hf: OpenRLHF always samples with vLLM")
    if r.precision == "fp32":  # OpenRLHF 0.11.2's create_vllm_engines passes dtype="bfloat16", no flag changes it
        raise Unsupported(("rollout", "precision"), "OpenRLHF's vLLM engines load the model in bfloat16 (its "
                          "create_vllm_engines has no dtype flag), so float32 rollout weights cannot be honoured",
                          "set rollout.precision: bf16 (or auto), or train on lightning")

    # ---- batch sizes ----
    pps, G = t.prompts_per_step, r.samples_per_prompt
    dp = actor_nodes * actor_gpn
    if (pps * G) % dp:
        raise Unsupported(("train", "prompts_per_step"), f"{pps} prompts x {G} samples do not split over {dp} "
                          "training GPUs", f"make prompts_per_step x samples_per_prompt a multiple of {dp}")
    micro = _divisor_at_most(pps * G // dp, t.micro_batch_size)
    rows = inputs.train_rows[run.name]
    p["train_file"], p["train_rows"] = inputs.train_file, rows  # the run's prompts (offline targets build from them)
    p["pool_factor"] = pool_factor(specs)
    a.add("data.prompt_dataset", inputs.train_file)
    a.add("data.input_key", "prompt")
    a.add("data.label_key", "label")
    a.add("data.max_samples", rows)
    a.add("rollout.batch_size", pps)
    a.add("rollout.n_samples_per_prompt", G)
    a.add("rollout.micro_batch_size", micro)
    updates = _updates(specs, where, native)
    if (pps * G) % (t.mini_batches * dp):
        raise Unsupported(("train", "mini_batches"), f"{pps} prompts x {G} samples do not split into {t.mini_batches} "
                          f"mini-batches over {dp} training GPUs", "choose mini_batches dividing the step's rollouts")
    a.add("train.batch_size", pps * G // t.mini_batches)
    a.add("train.micro_batch_size", _divisor_at_most(pps * G // t.mini_batches // dp, micro))
    a.add("train.max_epochs", t.epochs)
    if updates:
        run.native.append(updates)
    a.add("train.num_episodes", max(1, math.ceil(t.steps * pps / rows)))
    max_new = r.max_new_tokens if not inputs.toy else min(r.max_new_tokens, _toy_cap(spec))
    extra = _guide_room(specs, inputs)
    a.add("data.max_len", _max_len(run, specs, [where] * len(specs), inputs, model, inputs.max_prompt_chars + extra + max_new,
                                   extra + max_new))
    a.add("rollout.max_new_tokens", max_new)
    a.add("rollout.temperature", r.temperature)
    a.add("rollout.top_p", r.top_p)
    run.native += [f"{pps} prompts x {G} samples per step ({t.steps} steps: {rows} prompt rows, "
                   f"{t.epochs * t.mini_batches} optimizer step(s) per step)", f"vLLM sampling: temperature {r.temperature}, top_p {r.top_p}, up to {max_new} new "
                   "tokens", "data fields: prompt text and a JSON label (answer, reference solution, problem)",
                   _prompt_line(inputs)]
    if r.top_k:
        run.via_plugin.append(f"top_k {r.top_k} added to vLLM's SamplingParams (OpenRLHF has no top_k flag)")
    scorer = _reward_model_source(spec)
    if inputs.eval_file and scorer is not None:
        run.notes.append(f"no evaluation during the run: OpenRLHF evaluates with a reward function (--reward.remote_url), "
                         f"and this run's reward is the reward model '{scorer}'; evaluate the exported model with "
                         "`composer eval`")
    elif inputs.eval_file:
        a.add("eval.dataset", inputs.eval_file)
        a.add("eval.steps", t.eval_every or -1)
        a.add("eval.temperature", 0.0)
        a.add("eval.n_samples_per_prompt", 1)
        if t.eval_every:
            run.native.append(f"greedy pass@1 evaluation every {t.eval_every} steps on {inputs.eval_file}")
        else:  # Lightning's 0 is "only the final evaluation"; OpenRLHF's PPO trainer has none
            run.notes.append("no evaluation during the run: train.eval_every is 0, and OpenRLHF's PPO trainer has no "
                             "final evaluation (--eval.steps -1 never evaluates); evaluate the exported model with "
                             "`composer eval`")
    own = "toy" if spec.data.train is None else "math"  # what `auto` means
    reward_verifiers = {own if getattr(s, "verifier", None) == "auto" else getattr(s, "verifier", None)
                        for s in spec.sources.values() if "sequence_reward" in type(s).provides}
    if t.eval_verifier not in (None, "auto") and reward_verifiers != {t.eval_verifier}:
        raise Unsupported(("train", "eval_verifier"), "OpenRLHF evaluates with the reward function, which runs the "
                          "outcome_reward source's verifier", "drop train.eval_verifier, or evaluate the exported "
                          "model with `composer eval MODEL train.eval_verifier=...`")
    if t.entropy_coef:
        a.add("actor.entropy_coef", t.entropy_coef)
    _common(a, run, spec, layout, "actor.")

    # ---- signals: reward, teachers, guides ----
    rewards = {n for _, sig, _, _ in terms for field, names in sig.ref_names().items() for n in names
               if field != "plus" and "sequence_reward" in type(spec.sources[n]).provides}
    if len(rewards) > 1:
        raise Unsupported(("terms",), "OpenRLHF carries one reward per sample; these terms read "
                          f"{len(rewards)} reward sources ({', '.join(sorted(rewards))})", "use one outcome_reward")
    verifiers = rewards or {n for n, s in spec.sources.items() if "sequence_reward" in type(s).provides}
    if scorer is not None:
        verifiers = set()
        _reward_model_flags(a, run, spec, specs, where, inputs, scorer, layout)
    if verifiers:
        name = sorted(verifiers)[0]
        p["reward_source"], p["verifier"] = name, spec.sources[name].verifier
        if p["verifier"] == "auto":
            p["verifier"] = "toy" if inputs.toy else "math"
    for i, g in enumerate(gates(spec)):  # the advantage step reads success from the one reward each sample carries
        if g is not None and spec.rollout.environment.active and spec.rollout.environment.turn_reward_weight:
            raise Unsupported(where + ("terms", i, "gate"), "term gate: OpenRLHF reads success from the sample's "
                              "reward, which also holds the environment's per-turn rewards (turn_reward_weight "
                              f"{spec.rollout.environment.turn_reward_weight:g}); the gate reads its source's alone",
                              "set rollout.environment.turn_reward_weight: 0, or train it on the lightning backend")
        if g is not None and gate_source(g, spec) != p["reward_source"]:
            raise Unsupported(where + ("terms", i, "gate"), f"term gate: OpenRLHF carries one reward per sample (from "
                              f"'{p['reward_source']}'), and this gate decides success with "
                              f"'{gate_source(g, spec)}'", f"set the gate's source to '{p['reward_source']}'")
    _shaping_and_filter_flags(a, run, spec, terms, where, inputs)
    guided = any(not s.rollout.guide.plain for s in specs) or any(sig.targets_rows for _, sig, _, _ in terms)
    episodes = [s.rollout.environment for s in specs if s.rollout.environment.active]
    if guided or episodes:
        p["agent"] = True
        a.add("train.agent_func_path", "agent.py")
        _check_guides(specs, [where] * len(specs), inputs)
    if guided:
        run.via_plugin.append("guides: agent.py (an OpenRLHF AgentExecutor generated from the spec) runs the "
                              "guide through llm_engine.generate, returns trainable spans and the reward, and "
                              "carries per-sample provenance in the label / extra_logs; the guide follows the "
                              "trainer's step (phases)")
    if episodes:
        _environment_notes(run, specs, episodes)
    elif scorer is None:
        a.add("reward.remote_url", "reward.py")
        run.native.append(f"reward: reward.py (reward_func over the composer's '{p['verifier']}' verifier)"
                          + ("" if rewards else "; no term reads it, it is logged" if verifiers else "")
                          if verifiers else "reward: reward.py (no verifier: reward 0; the signal is the teacher)")
    _teachers(a, run, spec, specs, terms, inputs)

    # ---- objective ----
    if critic is not None:
        _critic_flags(a, run, critic, inputs, model)
    elif native:
        obj = _terms(spec)[0][2]
        lo = obj.clip if obj.clip_low is None else obj.clip_low
        hi = obj.clip if obj.clip_high is None else obj.clip_high
        estimator = _native_estimator(obj)
        a.add("algo.advantage.estimator", estimator)
        a.add("actor.policy_loss_type", "ppo")
        a.add("actor.eps_clip_low_high", lo, hi)
        a.add("actor.loss_agg_mode", obj.loss_agg)
        if obj.kl_coef > 0:
            a.add("algo.kl.use_loss")
            a.add("algo.kl.estimator", obj.kl_estimator)
            a.add("algo.kl.init_coef", obj.kl_coef)
        elif not p["teachers"]:
            a.add("algo.kl.init_coef", 0.0)
        for flag, *values in obj.correction.openrlhf_flags() or []:  # the rollout correction's own mapping
            a.add(flag, *values)
        if obj.correction.acts:
            run.native.append(f"rollout correction: {obj.correction.describe()} (OpenRLHF's PolicyLoss, "
                              "is_correction_*)")
        run.native.append(f"GRPO: {estimator} advantages over {G} samples, "
                          f"clipped policy loss ({lo}, {hi}), {obj.loss_agg}"
                          + (f", KL loss {obj.kl_estimator} x {obj.kl_coef} to the initial policy" if obj.kl_coef else ""))
        if estimator == "group_norm":
            run.notes.append(f"group_norm divides by std + 1e-9 (the composer's grpo: std + {obj.std_eps})")
    else:
        wants_initial = any(o.wants_initial for _, _, o, _ in terms)
        if wants_initial and p["ref"] != "initial":
            raise Unsupported(("sources",), "the reference slot holds the external teacher, but an objective also "
                              "needs the frozen initial policy", "drop the KL term (kl_coef: 0) or the initial anchor")
        a.add("algo.advantage.estimator", "reinforce")
        if wants_initial or p["ref"] != "initial":
            a.add("algo.kl.use_loss")
            a.add("algo.kl.init_coef", 1.0)
            if p["ref"] != "initial":
                a.add("algo.kl.estimator", "k1")
                a.add("algo.kl.unbiased_gradient")
        else:
            a.add("algo.kl.init_coef", 0.0)
        # every composer loss may read behaviour log-probs (a plugin's too): vLLM returns them always
        a.add("algo.advantage.is_correction_level", "token")
        run.native.append("behaviour log-probs from vLLM (is_correction_level token -> rollout_log_probs)")
        names = ", ".join(sorted(kinds))
        run.via_plugin.append(f"objective: the composer's {names} loss (components/objectives) replaces "
                              "OpenRLHF's PolicyLoss" + ("; per-sample advantages (V-hat / group statistics over the "
                              "whole step) come from the composer's functions in the make-experience step"
                              if kinds & {"advantage_regression", "grpo"} else "")
                              + f" (why not OpenRLHF's own: {'; '.join(dict.fromkeys(b for s in specs for b in native_blockers(s)))})")
    if p["sync"]:
        every = sorted({s.sync.every for s in specs})
        run.via_plugin.append(f"sync: weights broadcast to vLLM every {'/'.join(map(str, every))} step(s), counted "
                              "from each phase's start, after the steps the Plan's schedule names (OpenRLHF "
                              "broadcasts after every step)")
        run.notes.append("between syncs each step trains on its own fresh rollouts from the lagged vLLM weights "
                         "(OpenRLHF clears its replay buffer every step, as the Lightning backend)")


def _environment_notes(run: Run, specs, envs) -> None:
    """How the bundle runs episodes (rollout.environment): agent.py runs composer/episodes.py's program with the spec's
    own environment part, one rollout at a time, and hands OpenRLHF the policy's turns as `action_ranges` (environment
    tokens get action_mask 0: no loss, no KL, no log-prob in the ratio), the reward of the declared verifier over the
    final answer plus the per-turn rewards times turn_reward_weight, and the episode's counts as extra_logs (env/*)."""
    kinds = ", ".join(dict.fromkeys(e.kind_name() for e in envs))
    weights = {e.turn_reward_weight for e in envs if e.turn_reward_weight}
    run.via_plugin.append(
        f"environment: agent.py runs each rollout as an episode of policy turns and the '{kinds}' environment's "
        "answers (composer/episodes.py, the same part code as on Lightning); the answers are environment tokens "
        "outside OpenRLHF's action_ranges (action_mask 0: never in the loss); the reward is the verifier's over the "
        "final answer (after the last environment turn)"
        + (f" plus {'/'.join(f'{w:g}' for w in sorted(weights))} x the sum of the per-turn rewards" if weights else "")
        + "; env/turns, env/tool_calls, env/tool_errors, env/env_tokens and why episodes ended are logged per step")
    run.notes.append(f"data.max_len counts prompt + rollout.max_new_tokens + the environment's max_env_tokens "
                     f"({max(e.extra_tokens() for e in envs)}): OpenRLHF cuts every sequence at data.max_len")
    if any(e.runs_code for e in envs):
        run.notes.append("the python tool runs programs in the code sandbox (Linux namespaces, rlimits, seccomp) "
                         "inside the vLLM engine's Ray worker: the agent checks the sandbox when it starts and stops "
                         "the job with the reason where a node lacks it (never runs code without it)")


def _toy_cap(spec) -> int:
    from composer.registry import part

    return part("toy.max_new_tokens_for")(max(tuple(spec.data.tiers) + tuple(spec.data.train_tiers)), spec.data.toy_task)


def _guide_room(specs, inputs: Inputs) -> int:
    """Tokens a guide may add on top of prompt + response (prefix in the prompt, judge corrections), or an
    environment's answers in an episode (rollout.environment: at most its max_env_tokens)."""
    return max([s.rollout.guide.extra_tokens(s, inputs.max_solution_chars) + s.rollout.environment.extra_tokens()
                for s in specs] + [0])


def _context_limit(path: str | None) -> int | None:
    """The model's position limit from its config.json (None: not a readable local model)."""
    import json
    import os

    try:
        with open(os.path.join(path, "config.json")) as f:
            cfg = json.load(f)
    except (OSError, ValueError, TypeError):
        return None
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        if isinstance(cfg.get(key), int) and cfg[key] > 0:
            return cfg[key]
    return None


def _judge_lengths(spec, inputs: Inputs, response: int) -> tuple[str, int, int, int] | None:
    """(judge source, shortest and longest judge prompt, answer budget) of a model judge, in characters
    (an upper bound on tokens). The prompt is the judge template with the problem, the accepted steps
    ({accepted}, joined with step_split) and the new steps ({steps}, numbered "i:" one per line), plus each
    context source (a reference solution, or another response); accepted + new <= the response. The longest
    prompt counts every step at its shortest (one separator each); the shortest counts no numbering."""
    calls = spec.rollout.guide.model_calls(spec)
    if not calls:
        return None
    call = calls[0]  # a guide has one judge
    src = spec.sources[call.source]
    if src.template:
        template = src.template
    elif inputs.toy:
        from composer.registry import part

        TEMPLATES = part("toy.templates")
        template = max(TEMPLATES["judge"], TEMPLATES.get("correction", ""), key=len)
    else:
        return None  # refused by _check_guides
    problem = inputs.max_problem_chars or inputs.max_prompt_chars
    context = sum(max(inputs.max_solution_chars, response) for _ in src.context)
    steps = response // max(1, len(call.step_split)) + 1
    numbering = steps * (len(str(steps)) + 2)  # "i:" and the newline of each new step
    shortest = len(template) + problem + response + context + inputs.prompt_overhead_chars  # + chat turns
    return call.source, shortest, shortest + numbering, call.answer_tokens


def _max_len(run: Run, specs, where, inputs: Inputs, model: str, rollout: int, response: int) -> int:
    """--data.max_len, which OpenRLHF also passes to vLLM as max_model_len: room for the rollout and for the
    longest call of a judge that generates on the policy engine (a `self` judge). External judges get their
    own engine's max_model_len (plugin judge_max_len). Where the longest judge prompt passes the model's
    position limit, the limit is used: the agent skips a review whose prompt does not fit (it must check the
    length; see plugin lengths). Refused when even the shortest judge call cannot fit."""
    limit = _context_limit(model)
    self_need, ext_need, answer, longest = 0, 0, 0, 0
    for spec, w in zip(specs, where):
        j = _judge_lengths(spec, inputs, response)
        if j is None:
            continue
        name, lo, hi, ans = j
        src = spec.sources[name]
        own = limit if src.is_self else _context_limit(inputs.source_paths.get(name))
        if own is not None and lo + ans > own:
            raise Unsupported(w + ("sources", name), f"the judge's prompt (up to {lo} tokens before step numbers: "
                              f"template, problem, response, context) plus its answer ({ans}) exceed the "
                              f"{'policy' if src.is_self else 'judge'} model's context of {own} tokens",
                              "shorten rollout.max_new_tokens, max_reviews or max_correction_tokens, or the template")
        need = hi + ans if own is None else min(hi + ans, own)
        if src.is_self:
            self_need = max(self_need, need)
        else:
            ext_need = max(ext_need, need)
        answer, longest = max(answer, ans), max(longest, hi)
    max_len = max(rollout, self_need)
    if limit is not None and rollout > limit:
        raise Unsupported(("rollout", "max_new_tokens"), f"prompt + guide room + response ({rollout} tokens) exceed "
                          f"the policy model's context of {limit} tokens", "lower rollout.max_new_tokens")
    run.plugin["lengths"] = {"rollout": rollout, "max_len": max_len, "judge_prompt_max": longest,
                             "judge_answer": answer}
    run.plugin["judge_max_len"] = ext_need or None
    if self_need > rollout:
        run.native.append(f"data.max_len {max_len} (vLLM's max_model_len): the rollout needs {rollout}, the longest "
                          f"self-judge call {self_need}")
        run.notes.append(f"the agent keeps rollouts within {rollout} tokens (plugin lengths.rollout), not data.max_len")
    if longest + answer > max(max_len, ext_need or 0) and answer:
        run.notes.append("a judge prompt longer than the model's context minus the answer budget is skipped (the "
                         "review keeps the steps)")
    return max_len


def _check_guides(specs, where, inputs: Inputs) -> None:
    """What the agent cannot serve: a source that needs the toy testbed's step checker on other data, a model
    judge on other data without its own template, a judge that generates with weights the engines do not
    hold (the rollout engine holds the current weights; an external judge its own)."""
    from composer.checks.terms import scored_origins

    for spec, w in zip(specs, where):
        g = spec.rollout.guide
        scored = scored_origins(spec)
        if scored and spec.rollout.temperature != 1.0:
            # the agent scores guide-written tokens with vLLM's prompt_logprobs, which vLLM 0.32 never tempers, and
            # OpenRLHF's create_vllm_engines sets max_logprobs=1, so the agent cannot temper them over the vocabulary
            raise Unsupported(w + ("rollout", "temperature"), f"an objective reads the behaviour log-probs of tokens "
                              f"a guide wrote ({', '.join(sorted(scored))}) at the rollout's temperature "
                              f"{spec.rollout.temperature:g}; OpenRLHF's vLLM engines give them only untempered "
                              "(prompt log-probs are never tempered, and its engines return one log-prob per "
                              "position, so they cannot be tempered after)", "use rollout.temperature: 1, or the "
                              "lightning backend")
        for names in g.ref_names().values():
            for name in names:
                if spec.sources[name].needs_step_checker and not inputs.toy:
                    raise Unsupported(w + ("sources", name), "this source needs the task's step checker; only the "
                                      "toy testbed has one", "use a policy_model judge")
        for call in g.model_calls(spec):
            src = spec.sources[call.source]
            if not inputs.toy and not src.template:
                raise Unsupported(w + ("sources", call.source, "template"), "a judge on your data needs a prompt "
                                  "template (only the toy testbed has its own)", "give the source a `template` with "
                                  "{problem}, {accepted} and {steps}")
            if call.weights != "current":
                raise Unsupported(w + ("sources", call.source, "weights"), "a judge generates with the rollout "
                                  "engine (`self`: the current weights) or its own engine (an external model: its "
                                  "own weights)", "use weights: current")
            r = spec.rollout
            if call.sampled and (r.temperature != 1.0 or r.top_p != 1.0 or r.top_k):
                raise Unsupported(w + ("rollout", "temperature"), f"'{call.source}' samples the sequences it writes "
                                  f"(traces, prefixes) at the rollout's settings (temperature {r.temperature:g}, top_p "
                                  f"{r.top_p:g}{f', top_k {r.top_k}' if r.top_k else ''}) on the Lightning backend, "
                                  "and OpenRLHF's engine for an external model samples at temperature 1, top_p 1",
                                  "use rollout temperature 1 and top_p 1 without top_k, or the lightning backend")


def _teachers(a: _Args, run: Run, spec, specs, terms, inputs: Inputs) -> None:
    p = run.plugin
    for b, sig, obj, _ in terms:
        name = sig.teacher_source
        if name is None:
            continue
        src = spec.sources[name]
        info = {"self": src.is_self, "weights": src.weights, "context": list(src.context),
                "temperature": src.temperature, "path": inputs.source_paths.get(name)}
        if src.is_self:
            if src.weights != "current":
                beta = 1.0 if src.weights == "initial" else 1.0 - src.ema_rate
                if p["ema_beta"] not in (None, beta):
                    raise Unsupported(("sources", name, "weights"), "OpenRLHF keeps one EMA copy of the policy; two "
                                      "self-teachers with different weights need two")
                p["ema_beta"] = beta
                a.add("train.enable_ema")
                a.add("train.ema_beta", beta)
                run.native.append(f"teacher '{name}' weights: OpenRLHF's EMA copy of the policy, beta {beta}"
                                  + (" (a frozen initial copy)" if beta == 1.0 else ""))
            run.via_plugin.append(f"teacher '{name}': the policy{chr(39) + 's EMA copy' if src.weights != 'current' else ''} "
                                  f"scores each response under a privileged-context prompt ({', '.join(src.context) or 'none'}) "
                                  "built over the whole step (make_experience override), in the training step")
        else:
            if src.context:
                raise Unsupported(("sources", name, "context"), "an external teacher is loaded in OpenRLHF's "
                                  "reference slot, which scores the policy's own sequence: it cannot see a context")
            if obj.wants_logits:
                raise Unsupported(b + ("objective", "estimator"), f"estimator '{obj.estimator}' needs the external "
                                  "teacher's full logits; OpenRLHF's reference slot returns sampled-token log-probs",
                                  "use estimator: sampled")
            if not src.shares_tokenizer:
                raise Unsupported(("sources", name, "shares_tokenizer"), "the teacher scores the policy's token ids")
            if p["ref"] not in ("initial", name):
                raise Unsupported(("sources", name), "OpenRLHF has one reference slot; two external teachers need two")
            p["ref"] = name
            run.via_plugin.append(f"teacher '{name}': {info['path']} loaded where OpenRLHF loads the reference model "
                                  "(its log-probs arrive as base_action_log_probs)")
        p["teachers"][name] = info


# ------------------------------------------------------------------------------- PPO's critic, a reward model

WIDE_REWARD_CLIP = 1e10  # OpenRLHF clips the sequence reward to --reward.clip_range (default +-10); the composer does not


def _critic_objective(specs, where, later_stage: bool):
    """The objective with a critic (`value_model()`, PPO) of this run, checked to run on OpenRLHF's own critic
    (CriticModelActor, --algo.advantage.estimator gae, ValueLoss) and PolicyLoss; None when no term has one.
    Unsupported names what OpenRLHF cannot do with a critic: the per-token advantages of GAE live in OpenRLHF's
    Experience.advantages and reach only its own PolicyLoss, so nothing of the composer's plugin loss can join them."""
    found = [(spec, w, b, o) for spec, w in zip(specs, where) for b, _s, o, _w in _terms(spec)
             if o is not None and o.value_model() is not None]
    if not found:
        return None
    spec, w, b, obj = found[0]
    path = w + b + ("objective",)
    if len({repr(_terms(s)) for s in specs}) > 1 or len(found) != len(specs):
        raise Unsupported(path, "OpenRLHF's critic is created for the whole run; its phases cannot change the "
                          "objective or the critic", "keep one ppo objective in every phase, or use `stages`")
    if len(_terms(spec)) != 1 or _terms(spec)[0][3] != 1.0:
        raise Unsupported(path, "OpenRLHF's critic runs with its own PolicyLoss, one objective: other terms (the "
                          "composer's plugin loss) cannot join the per-token GAE advantages it keeps in "
                          "Experience.advantages", "train this mix on the lightning backend")
    if not type(spec.rollout.guide).plain or any(g is not None for g in gates(spec)):
        raise Unsupported(w + (("rollout", "guide") if not type(spec.rollout.guide).plain else ("terms", 0, "gate")),
                          "a guide or a term gate needs the composer's agent or loss, and OpenRLHF's critic and GAE "
                          "run only with its own PolicyLoss", "train it on the lightning backend")
    if obj.loss_tokens != ["policy"]:
        raise Unsupported(path + ("loss_tokens",), "OpenRLHF's PolicyLoss trains the policy's own tokens (the "
                          "action mask)", "use loss_tokens: [policy]")
    if obj.loss_agg not in NATIVE_AGG:
        raise Unsupported(path + ("loss_agg",), f"OpenRLHF's --actor.loss_agg_mode takes {', '.join(NATIVE_AGG)}",
                          "use one of them, or the lightning backend")
    if obj.lambd == "adaptive":
        raise Unsupported(path + ("lambd",), "OpenRLHF's GAE takes one number for every row (--algo.advantage.lambd): "
                          "it has no lambda per response length", "give lambd a number, or train on the lightning backend")
    if obj.decoupled:
        raise Unsupported(path + ("critic_lambda",), "OpenRLHF computes the advantages and the critic's returns in one "
                          "GAE pass with one --algo.advantage.lambd (get_advantages_and_returns): the critic's targets "
                          "cannot take their own lambda", "drop critic_lambda (or set it to lambd), or train on the "
                          "lightning backend")
    c = obj.value_model()
    if c.network != "own":
        raise Unsupported(path + ("critic", "network"), "OpenRLHF's critic is a model of its own (CriticModelActor "
                          "with a value head); it has no head on the actor's network", "use critic.network: own")
    if c.value_clip is None:
        raise Unsupported(path + ("critic", "value_clip"), "OpenRLHF's ValueLoss is built with --critic.value_clip, a "
                          "number (default 0.5): it cannot be switched off", "give critic.value_clip a number")
    if obj.whiten == "none":
        raise Unsupported(path + ("whiten",), "OpenRLHF normalises GAE advantages over the step's action tokens "
                          "(the mean always, the std unless --algo.advantage.no_std_norm)", "use whiten: mean_std or mean")
    if spec.rollout.filter.truncated != "keep":
        raise Unsupported(w + ("rollout", "filter", "truncated"), "masking rows takes the composer's loss, and "
                          "OpenRLHF's critic runs only with its own PolicyLoss", "use truncated: keep")
    if later_stage and spec.train.critic_at_stage == "keep":
        raise Unsupported(w + ("train", "critic_at_stage"), "each stage is a new OpenRLHF run, whose critic starts again "
                          "from the stage's model, while train.critic_at_stage: keep carries the previous stage's critic "
                          "on", "set train.critic_at_stage: reset in this stage (a fresh critic from the stage's starting "
                          "policy on both backends), put PPO in the first stage, or train on the lightning backend")
    return obj


def _critic_flags(a: _Args, run: Run, obj, inputs: Inputs, model: str) -> None:
    """PPO with a critic on OpenRLHF's own parts: the critic actor (colocated with the actor), GAE, ValueLoss, the KL
    in the reward, PolicyLoss; its optimizer on the critic's flags."""
    c = obj.value_model()
    lo, hi = obj.bounds()
    actor = _flag_values(a.argv)
    if "--train.colocate_all" not in actor:
        raise Unsupported(("objective", "critic"), "the bundle places OpenRLHF's critic on the actor's GPUs, which "
                          "needs the colocated layout", "compile with --colocate")
    path = model if c.model is None else inputs.critic_paths.get("critic", c.model)
    a.add("algo.advantage.estimator", "gae")
    a.add("algo.advantage.gamma", obj.gamma)
    a.add("algo.advantage.lambd", obj.lambd)
    if obj.whiten == "mean":
        a.add("algo.advantage.no_std_norm")
    a.add("critic.model_name_or_path", path)
    a.add("critic.num_nodes", *actor["--actor.num_nodes"])
    a.add("critic.num_gpus_per_node", *actor["--actor.num_gpus_per_node"])
    a.add("critic.value_clip", c.value_clip)
    spec_lr = float(actor["--actor.adam.lr"][0])
    for flag in ("adam.betas", "adam.weight_decay", "lr_scheduler", "lr_warmup_ratio", "max_norm"):
        a.add(f"critic.{flag}", *actor[f"--actor.{flag}"])
    a.add("critic.adam.lr", c.lr if c.lr is not None else spec_lr)
    a.add("algo.kl.init_coef", obj.kl_coef)
    if obj.kl_coef:
        a.add("algo.kl.estimator", obj.kl_estimator)
    a.add("reward.clip_range", -WIDE_REWARD_CLIP, WIDE_REWARD_CLIP)
    a.add("actor.policy_loss_type", "ppo")
    a.add("actor.eps_clip_low_high", lo, hi)
    a.add("actor.loss_agg_mode", obj.loss_agg)
    run.native.append(f"PPO with a critic: OpenRLHF's CriticModelActor from {path}"
                      + (" (the policy's checkpoint: a new value head `score`, as the composer's critic)"
                         if c.model is None else "") + f", ValueLoss clip {c.value_clip:g}, its own AdamW lr "
                      f"{c.lr if c.lr is not None else spec_lr:g}; GAE (--algo.advantage.estimator gae, gamma "
                      f"{obj.gamma:g}, lambda {obj.lambd:g}), advantages "
                      + ("whitened" if obj.whiten == "mean_std" else "centred") + " over the step; "
                      + (f"KL in the reward: -{obj.kl_coef:g} x {obj.kl_estimator} (--algo.kl.init_coef)"
                         if obj.kl_coef else "no KL")
                      + f"; PolicyLoss ppo clip ({lo:g}, {hi:g}), {obj.loss_agg}")
    run.notes.append("OpenRLHF's KL in the reward reads the actor's log-probs of the make-experience step (the "
                     "composer's: the sampler's, the same weights on-policy); its critic and actor shuffle the step's "
                     "rows into mini-batches (the composer's: whole groups in order); the sequence reward is not "
                     f"clipped (--reward.clip_range +-{WIDE_REWARD_CLIP:g})")


def _reward_model_source(spec) -> str | None:
    """The reward_model source a term's reward signal reads (None: none)."""
    for _b, sig, _o, _w in _terms(spec):
        for name in (sig.ref_names().get("source", []) if sig is not None else []):
            if spec.sources[name].scored_by_model:
                return name
    return None


def _reward_model_flags(a: _Args, run: Run, spec, specs, where, inputs: Inputs, name: str, layout: Layout) -> None:
    """A reward_model source as OpenRLHF's own reward model (RewardModelActor, --reward.model_name_or_path): it scores
    the policy's token ids (`sequences`) and reads the score at the last non-padding token."""
    src = spec.sources[name]
    path = where + ("sources", name)
    if any(not s.rollout.guide.plain for s in specs):
        raise Unsupported(path, "OpenRLHF's reward model runs without an agent: a guide's agent returns the reward "
                          "itself (--train.agent_func_path sets the reward to the agent's)", "train it on lightning")
    if src.input != "tokens":
        raise Unsupported(path + ("input",), "OpenRLHF's reward model scores the policy's token ids as they are; it "
                          "cannot re-tokenise the text with its own tokenizer and chat template",
                          "use input: tokens (the reward model must share the policy's vocabulary), or lightning")
    if src.normalize == "running":
        raise Unsupported(path + ("normalize",), "OpenRLHF normalises a reward model's score by the mean and std in "
                          "its config.json (--reward.normalize_enable), not by running statistics",
                          "use normalize: config or none")
    located = inputs.source_paths.get(name, src.model)
    differ = _vocabularies_differ(located, inputs.policy_path)
    if differ:
        raise Unsupported(path + ("model",), f"the reward model's tokenizer differs from the policy's ({differ}), and "
                          "OpenRLHF's reward model scores the policy's token ids", "use a reward model of the policy's "
                          "tokenizer, or input: text on the lightning backend")
    actor = _flag_values(a.argv)
    if "--train.colocate_all" not in actor:
        raise Unsupported(path, "the bundle places OpenRLHF's reward model on the actor's GPUs, which needs the "
                          "colocated layout", "compile with --colocate")
    a.add("reward.model_name_or_path", located)
    a.add("reward.num_nodes", *actor["--actor.num_nodes"])
    a.add("reward.num_gpus_per_node", *actor["--actor.num_gpus_per_node"])
    if src.normalize == "config":
        a.add("reward.normalize_enable")
    run.plugin["reward_source"], run.plugin["verifier"] = name, "none"
    run.native.append(f"reward: OpenRLHF's reward model {located} (RewardModelActor) on the policy's token ids, the "
                      "score at the last non-padding token" + (", normalised by its config's mean and std"
                                                               if src.normalize == "config" else ""))


def _vocabularies_differ(a: str, b: str) -> str | None:
    """Why two local tokenizers differ ("N vs M tokens", "other token ids"), None when equal or not both readable here
    (a hub id or a directory only the cluster has: the cluster's run checks nothing, OpenRLHF scores the ids)."""
    import os

    if not (os.path.isdir(a) and os.path.isdir(b)):
        return None
    try:
        from transformers import AutoTokenizer

        ta, tb = AutoTokenizer.from_pretrained(a), AutoTokenizer.from_pretrained(b)
    except Exception:  # noqa: BLE001 - unreadable here: the run decides
        return None
    va, vb = ta.get_vocab(), tb.get_vocab()
    if va == vb:
        return None
    return f"{len(va)} vs {len(vb)} tokens" if len(va) != len(vb) else "other token ids"
