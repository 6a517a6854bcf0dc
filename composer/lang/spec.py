"""The spec models: top-level sections, with the component sections as tagged unions from the registry."""

from __future__ import annotations

from typing import Annotated, Any, Literal, Optional, Union

import re

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, ValidationInfo, WithJsonSchema, create_model, field_validator, model_validator
from pydantic.fields import FieldInfo
from pydantic_core import PydanticCustomError

from composer import registry
from composer.capabilities import Capabilities, Capable, Need
from composer.filters import RolloutFilter
from composer.gates import Gate
from composer.lang.curves import ScheduledNumber, is_scheduled

# Bounds: far beyond any real run, but inside what the runtime can count and allocate (int64 step
# counters, one batch in memory). A value past them is a typo or an attack, refused before anything runs.
MAX_STEPS = 10**9
MAX_BATCH = 1 << 16
MAX_TOKENS = 1 << 20
MAX_TOY_TIER = 32  # the toy testbed's chains of up to 32 steps fit its 512-token context
NAME_PATTERN = r"^[a-z0-9_-]+$"


def _check_name(value: str) -> str:
    """Names of sources and terms reach logs, metrics and explain's diagrams: plain [a-z0-9_-]+ only."""
    if not re.fullmatch(NAME_PATTERN, value):
        fixed = re.sub(r"[^a-z0-9_-]+", "_", value.lower()).strip("_") or "name"
        raise PydanticCustomError("name_pattern", "the name {name} is not allowed: names are [a-z0-9_-]+ "
                                  "(lower-case letters, digits, _ and -), e.g. '{fixed}'",
                                  {"name": ascii(value), "fixed": fixed})
    return value


Name = Annotated[str, AfterValidator(_check_name), WithJsonSchema({"type": "string", "pattern": NAME_PATTERN})]


class Strict(Capable, registry.NumbersNotBooleans, BaseModel):
    model_config = ConfigDict(extra="forbid")


class Lora(Strict):
    """LoRA adapters (Hu et al. 2021, arXiv 2106.09685) through peft: W = W0 + (alpha / r) B A on the target modules."""

    r: int = Field(16, ge=1, le=4096, description="Adapter rank r.")
    alpha: float = Field(32.0, gt=0, description="Scale numerator: the update is (alpha / r) B A.")
    dropout: float = Field(0.0, ge=0, lt=1, description="Dropout on the adapter's input.")
    target_modules: Union[Literal["all-linear"], Annotated[list[str], Field(min_length=1)]] = Field("all-linear", description="Modules that get adapters: `all-linear` (every linear layer but the output head) or module names such as [q_proj, v_proj].")


class Policy(Strict):
    model: Optional[str] = Field(None, description="Model id or local directory loaded with `from_pretrained`; omitted -> the toy testbed's student. `toy:<name>` names a toy checkpoint: student, teacher, instruct (InT's base), tools (the tool task's base, data.toy_task: tools), built when first named.")
    tokenizer: Optional[str] = Field(None, description="Tokenizer directory, when it differs from `model`.")
    dtype: Literal["float32", "bfloat16", "float16"] = Field("float32", description="Parameter dtype of the trained policy.")
    trust_remote_code: bool = Field(False, description="Run the Python code a model folder ships (transformers `trust_remote_code`); off: such a folder is refused instead of asking mid-run. Only for folders you trust.")
    lora: Optional[Lora] = Field(None, description="Train LoRA adapters instead of every weight (peft). The frozen initial policy (KL reference, `weights: initial` teachers and judges) is then the base model with the adapter off, not a copy; the exported model has the adapter merged.")
    gradient_checkpointing: bool = Field(False, description="Recompute activations in the backward pass instead of keeping them (transformers gradient checkpointing): less memory, more compute.")

    def capabilities(self) -> Capabilities:
        return Capabilities(needs=(Need("separate_tokenizer", ("tokenizer",)),)
                            if self.tokenizer and self.tokenizer != self.model else ())


class Data(Strict):
    train: Optional[str] = Field(None, description="Training prompts: a jsonl, json, csv or parquet file, a folder of data files (shards, a hub snapshot's layout), a `datasets` save_to_disk folder, or a hub dataset id (org/name) already in the local Hugging Face cache (never downloaded); omitted -> the toy testbed.")
    eval: Optional[str] = Field(None, description="Held-out evaluation prompts, same formats as `train`; omitted with `eval_split` set: that split of `train`.")
    split: Optional[str] = Field(None, description="The split of `train` to train on, for a source with several (a DatasetDict, a folder of train-/test- files); default `train` (or its only split).")
    eval_split: Optional[str] = Field(None, description="The split of `eval` (or of `train` when `eval` is omitted) to evaluate on; default the source's `test`, else `validation`, else its only split.")
    prompt_field: str = Field("prompt", description="Field holding the problem text.")
    answer_field: str = Field("answer", description="Field holding the final answer the verifier checks.")
    solution_field: str = Field("solution", description="Field holding a step-by-step reference solution (for reference_solution sources).")
    on_bad_row: Literal["error", "skip"] = Field("error", description="A row with a missing or unusable field: stop with an error naming file, row and field, or skip and count it.")
    tiers: list[Annotated[int, Field(ge=1, le=MAX_TOY_TIER)]] = Field(default_factory=lambda: [1, 2, 4, 6, 8], min_length=1, description=f"Toy testbed only: chain lengths (steps, 1-{MAX_TOY_TIER}) of the difficulty tiers.")
    train_tiers: list[Annotated[int, Field(ge=1, le=MAX_TOY_TIER)]] = Field(default_factory=lambda: [2, 4, 6], min_length=1, description=f"Toy testbed only: the chain lengths (1-{MAX_TOY_TIER}) training prompts are drawn from.")
    toy_task: Literal["chains", "tools"] = Field("chains", description="Toy testbed only: which toy task. `chains`: the arithmetic chains (prompt `Q:7+3-5+9\\nA:`); `tools`: the same chains with a calculator tool announced (prompt `Tools: calculator\\nQ:7+3-5+9\\nA:`), for a rollout environment that answers the policy's tool calls (rollout.environment kind tools) and a policy that knows the tool (toy:tools).")
    prompt_format: Literal["auto", "chat", "plain"] = Field("auto", description="How a row becomes the policy's prompt. `chat`: the policy tokenizer's chat template (`system_prompt` as the system message when given, `prompt_template` filled with the row's text as the user message, add_generation_prompt), tokenized once with no special tokens added after it; `plain`: the filled `prompt_template` as it is (after `system_prompt` and a blank line, when given); `auto`: chat when the tokenizer has a chat template, else plain. Teachers' and judges' privileged prompts and the OpenRLHF bundle's data are rendered the same way. Checked when the tokenizer loads (run, compile, explain), never by `validate`. Data files only: the toy testbed's prompts are its own.")
    system_prompt: Optional[str] = Field(None, description="System message of every prompt the policy, its teachers and judges see (chat: the template's system turn; plain: text before the prompt and a blank line). Data files only.")
    prompt_template: str = Field("{prompt}", description="The user message built from the row's `prompt_field` text, written {prompt}, e.g. \"{prompt}\\nPut your final answer within \\\\boxed{{}}.\" (a literal brace is {{ or }}). Data files only.")
    chat_template_kwargs: dict[str, Union[bool, int, float, str]] = Field(default_factory=dict, description="Extra variables for the chat template (transformers `apply_chat_template` keyword arguments), e.g. {enable_thinking: false} for Qwen3. Data files only.")

    @field_validator("prompt_template")
    @classmethod
    def _one_prompt_field(cls, value: str) -> str:
        import string

        try:
            parts = list(string.Formatter().parse(value))
        except ValueError as e:
            raise ValueError(f"not a valid template ({e}); a literal brace is written {{{{ or }}}}") from None
        names = [name for _lit, name, _spec, _conv in parts if name is not None]
        for _lit, name, spec, conv in parts:
            if name is not None and (name != "prompt" or spec or conv):
                raise ValueError(f"'{{{name}{'!' + conv if conv else ''}{':' + spec if spec else ''}}}' is not a field "
                                 "of a prompt template: the only field is {prompt} (the row's prompt_field text); a "
                                 "literal brace is written {{ or }}")
        if "prompt" not in names:
            raise ValueError("the template has no {prompt}: the row's text would be left out of the prompt")
        return value

    @model_validator(mode="after")
    def _toy_prompts_are_fixed(self):
        if self.train is None:
            changed = [f for f, on in (("prompt_format", self.prompt_format == "chat"),
                                       ("system_prompt", self.system_prompt is not None),
                                       ("prompt_template", self.prompt_template != "{prompt}"),
                                       ("chat_template_kwargs", bool(self.chat_template_kwargs))) if on]
            if changed:
                raise ValueError(f"{', '.join('data.' + f for f in changed)}: the toy testbed (no data.train) writes its "
                                 "own prompts and its tokenizer has no chat template; these apply to data files "
                                 "(give data.train, e.g. from `composer toy-data --out DIR`)")
            splits = [f for f in ("split", "eval_split") if getattr(self, f) is not None]
            if splits:
                raise ValueError(f"{', '.join('data.' + f for f in splits)}: the toy testbed (no data.train) has no "
                                 "splits; these choose a split of a data source")
        return self


class Rollout(Strict):
    samples_per_prompt: int = Field(8, ge=1, le=MAX_BATCH, description="Responses sampled per prompt (the group size G).")
    max_new_tokens: int = Field(1024, ge=1, le=MAX_TOKENS, description="Largest number of response tokens per rollout (the toy testbed caps it at what its task needs).")
    temperature: float = Field(1.0, gt=0, allow_inf_nan=False, description="Sampling temperature.")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling threshold.")
    top_k: int = Field(0, ge=0, le=MAX_TOKENS, description="Top-k sampling; 0 disables.")
    engine: Literal["auto", "hf", "vllm"] = Field("auto", description="Rollout engine: `hf` (transformers generate), `vllm`, or `auto` (vLLM when installed and a GPU is present, else hf).")
    precision: Literal["auto", "fp32", "bf16"] = Field("auto", description="The rollout weights' precision: auto (the engine's own: the trainer's weights as they are in the hf engine, the policy's dtype in vLLM; bf16 on OpenRLHF, whose vLLM engines load bfloat16), fp32, or bf16, the weights rounded to bfloat16 as an inference engine serving bf16 holds them (the hf engine rounds its copy at every sync and computes in float32; vLLM loads the model in bfloat16). With bf16 the sampler's log-probs differ from the trainer's by the training-inference mismatch (logged as mismatch/*), which objective.correction weighs.")
    gpu_memory_utilization: float = Field(0.5, gt=0, le=1, description="vLLM only: fraction of GPU memory the engine may take.")
    tensor_parallel_size: int = Field(1, ge=1, le=1024, description="vLLM only: tensor-parallel degree of the rollout engine.")
    guide: Any = Field(None, description="Who else writes tokens into rollouts (none, prefix, intervention).")
    environment: Any = Field(None, description="Who answers the policy between its turns (none, tools, a plugin's kind): an active environment makes each rollout an episode of policy turns and environment turns.")
    filter: RolloutFilter = Field(default_factory=RolloutFilter, description="Which rollouts a step trains on, decided after rewards and before advantages: drop prompts whose rewards are all equal and sample more (DAPO dynamic sampling), keep / mask / drop responses cut at max_new_tokens (overlong filtering).")


class Sync(Strict):
    every: int = Field(1, ge=1, le=MAX_STEPS, description="Refresh the rollout weights from the trainer every this many optimiser steps (1 = on-policy).")
    clear_buffer: bool = Field(True, description="With reuse: drop the stored rollouts of older weights at each sync (false: keep them next to the new ones). Refused without reuse: then every rollout is trained on once, in its own step, and nothing is stored to clear.")
    reuse: bool = Field(False, description="Sample once per sync interval and train on the stored rollouts at every step until the next sync (offline rounds), instead of sampling fresh from the lagged weights each step.")
    off_policy_ok: bool = Field(False, description="Allow every > 1 with an objective that assumes on-policy data (to study the lag on purpose).")

    def capabilities(self) -> Capabilities:
        return Capabilities(needs=(Need("rollout_reuse", ("reuse",)),) if self.reuse else ())


class Train(Strict):
    steps: int = Field(100, ge=1, le=MAX_STEPS, description="Optimiser steps.")
    prompts_per_step: int = Field(8, ge=1, le=MAX_BATCH, description="Prompts sampled per step (each gets samples_per_prompt rollouts).")
    lr: float = Field(1.0e-6, gt=0, allow_inf_nan=False, description="Peak learning rate (AdamW).")
    betas: list[Annotated[float, Field(ge=0, lt=1)]] = Field(default_factory=lambda: [0.9, 0.999], min_length=2, max_length=2, description="AdamW betas, each in [0, 1).")
    weight_decay: float = Field(0.0, ge=0, allow_inf_nan=False, description="AdamW (decoupled) weight decay: each step multiplies the weights by 1 - lr * weight_decay, so lr * weight_decay must stay below 1.")
    warmup_steps: int = Field(0, ge=0, le=MAX_STEPS, description="Linear warm-up steps.")
    lr_schedule: Literal["constant", "cosine"] = Field("constant", description="Learning-rate schedule after warm-up.")
    grad_clip: float = Field(1.0, ge=0, allow_inf_nan=False, description="Gradient-norm clip; 0 disables.")
    entropy_coef: ScheduledNumber = Field(0.0, description="Subtract this times the token-mean entropy from the loss: a number or a schedule ({kind: linear|cosine|step, start, end, steps, begin}).")
    epochs: int = Field(1, ge=1, le=64, description="Passes over each step's rollouts (PPO epochs; TRL num_iterations, verl ppo_epochs, OpenRLHF max_epochs). With epochs x mini_batches > 1 the importance ratio's denominator is the policy's log-prob at the start of the step's first pass (`old`), the behaviour log-prob stays the sampler's.")
    mini_batches: int = Field(1, ge=1, le=MAX_BATCH, description="Optimizer steps per pass: the step's groups split into this many mini-batches of whole groups (verl ppo_mini_batch_size, OpenRLHF train_batch_size = rollouts / mini_batches).")
    seed: int = Field(0, ge=0, le=2**32 - 1, description="Random seed for data order, sampling and initialisation.")
    backend: Literal["lightning", "openrlhf"] = Field("lightning", description="Which backend compiles the run.")
    micro_batch_size: int = Field(64, ge=1, le=MAX_BATCH, description="Sequences per forward pass when computing log-probs and loss.")
    eval_every: int = Field(20, ge=0, le=MAX_STEPS, description="Evaluate pass@1 on each tier every this many steps (0: only at the end).")
    eval_samples: int = Field(64, ge=1, le=MAX_BATCH, description="Evaluation prompts per tier (a data file's eval split: its first this many rows).")
    eval_k: int = Field(0, ge=0, le=1024, description="Also sample this many answers per evaluation problem at the rollout's temperature and log the unbiased pass@k (Chen et al. 2021) for k = 2, 4, ..., eval_k and pass@1_sampled; 0 or 1: greedy pass@1 only.")
    eval_verifier: Optional[str] = Field(None, description="The registered verifier that scores evaluation (`composer list verifiers`); default: the verifier of the spec's outcome_reward source, else the task's own (math for data files, toy for the toy testbed).")
    log_every: int = Field(10, ge=1, le=MAX_STEPS, description="Without a progress bar (no terminal, or --no-progress): print one line every this many steps (step, loss, reward, pass@1 when evaluated, tokens/s, ETA) and after the last step. Lightning backend (OpenRLHF prints its own logs).")
    checkpoint_every: int = Field(50, ge=1, le=MAX_STEPS, description="Write a checkpoint every this many steps.")
    devices: Union[Literal["auto"], Annotated[int, Field(ge=1, le=1024)],
                   Annotated[list[Annotated[int, Field(ge=0, le=1023)]], Field(min_length=1, max_length=1024)]] = Field(
        "auto", description="Lightning `devices`: auto, a count (>= 1), or a list of device indices.")
    accelerator: Literal["auto", "cpu", "gpu", "cuda", "mps"] = Field("auto", description="Lightning accelerator.")
    strategy: Literal["auto", "ddp", "fsdp"] = Field("auto", description="Lightning strategy.")
    precision: Literal["32-true", "bf16-mixed", "16-mixed", "bf16-true", "16-true", "64-true"] = Field("32-true", description="Lightning precision.")
    num_nodes: int = Field(1, ge=1, le=1024, description="Nodes for multi-node Lightning runs (more than 1 needs a multi-node launcher: SLURM, torchrun, or NODE_RANK/MASTER_ADDR set).")
    compile: bool = Field(False, description="torch.compile (inductor, dynamic shapes) the training and initial-policy forward passes and the hf rollout engine's decode step (one graph for every batch and cache size; for the models its KV-cache sampler covers, the Llama family, else a warning says it samples uncompiled); the first steps pay the compile time. Lightning backend.")
    samples_every: int = Field(10, ge=0, le=MAX_STEPS, description="Write every rollout of every this many steps, of each evaluation step (train.eval_every) and of the last step to `samples.jsonl` in the run folder (prompt, response as origin spans, reward, verifier detail, the judge's verdicts and corrections; `composer samples RUN` prints them); 0: none.")
    loggers: list[Literal["csv", "tensorboard", "wandb", "mlflow"]] = Field(default_factory=lambda: ["csv", "tensorboard"], max_length=4, description="Lightning loggers of the run: `csv` (metrics.csv in the run folder), `tensorboard` (tensorboard/; left out without a word when the package is missing and the list is the default), `wandb` (WandbLogger: WANDB_PROJECT, WANDB_MODE=offline honoured), `mlflow` (MLFlowLogger: MLFLOW_TRACKING_URI, default mlruns/ in the run folder). A chosen logger whose package is missing stops the run before anything is written. The base spec's list applies to the whole run.")
    optimizer_at_stage: Literal["reset", "keep"] = Field("reset", description="The optimizer state (AdamW moments and step count) at the start of this stage: `reset` starts it fresh, as a new run would (OpenRLHF launches each stage as a new run); `keep` carries the previous stage's state on (Lightning only). The learning-rate program is the stage's own either way. Without stages there is nothing to reset.")
    critic_at_stage: Literal["keep", "reset"] = Field("keep", description="A learned critic (ppo's value model: its weights, AdamW state and update count) at the start of this stage: `keep` carries on the previous stage's critic of the term of the same name (its lr and value_clip may change; its network may not), `reset` starts a fresh one (an own network from the policy's weights at that point, or critic.model). A term without a critic in the previous stage starts a fresh critic either way; the critic is kept across phases. OpenRLHF launches each stage as a new run, whose critic starts afresh: a critic in a later stage is refused there.")
    freeze_policy: bool = Field(False, description="Freeze the policy in this segment (phase or stage): no policy loss, no policy optimizer step and no change to its AdamW state, while a learned critic (ppo, an own network) keeps learning on the rollouts of the frozen policy (VAPO's value pre-training, Yue et al. 2025, arXiv 2504.05118). Validation refuses it where no term has a critic of its own network. OpenRLHF: the first steps of a run (--critic.freezing_steps).")
    reset_every: int = Field(0, ge=0, le=MAX_STEPS, description="Every this many steps of a segment (phase or stage), counted from its start, before the step: the frozen reference becomes the current policy and the optimizer state starts fresh (ProRL's periodic reference reset, Liu et al. 2025, arXiv 2505.24864; `reset_what` chooses which); 0: never. Lightning backend.")
    reset_what: list[Literal["reference", "optimizer"]] = Field(default_factory=lambda: ["reference", "optimizer"], min_length=1, max_length=2, description="What a periodic reset (reset_every) resets: the frozen reference weights (KL terms, `weights: initial`) and/or the optimizer state.")
    reference: Literal["stage_start", "run_start"] = Field("stage_start", description="The frozen reference weights (`initial`: KL terms, A*PO's anchor, `weights: initial` teachers and judges): the policy at the start of each stage (as OpenRLHF starts a stage from the previous stage's checkpoint), or at the start of the run. Without stages both are the start of the run.")

    def capabilities(self) -> Capabilities:
        needs = [Need("periodic_reset", ("reset_every",))] if self.reset_every else []
        needs += [Need("sampled_eval", ("eval_k",))] if self.eval_k > 1 else []
        needs += [Need("scheduled_entropy", ("entropy_coef",))] if is_scheduled(self.entropy_coef) else []
        return Capabilities(needs=tuple(needs))

    @field_validator("eval_verifier")
    @classmethod
    def _registered_verifier(cls, value: Optional[str]) -> Optional[str]:
        from composer.errors import did_you_mean
        from composer.registry import VERIFIERS

        if value is not None and value != "auto" and value not in VERIFIERS:
            raise PydanticCustomError("unknown_verifier", "unknown verifier {name} ({hint})",
                                      {"name": ascii(value), "hint": did_you_mean(value, ["auto", *VERIFIERS])})
        return value

    @field_validator("weight_decay")
    @classmethod
    def _decay_below_one(cls, value: float, info: ValidationInfo) -> float:
        lr = info.data.get("lr")
        if lr is not None and lr * value >= 1:
            raise ValueError(f"lr * weight_decay = {lr * value:g}: AdamW multiplies the weights by 1 - lr * weight_decay "
                             "each step, which must stay above 0")
        return value

    @field_validator("reset_what")
    @classmethod
    def _distinct_resets(cls, value):
        if len(set(value)) != len(value):
            raise ValueError("a reset target is listed twice")
        return value

    @field_validator("loggers")
    @classmethod
    def _distinct_loggers(cls, value):
        if len(set(value)) != len(value):
            raise ValueError("a logger is listed twice")
        return value

    @field_validator("devices")
    @classmethod
    def _distinct_devices(cls, value):
        if isinstance(value, list) and len(set(value)) != len(value):
            raise ValueError("a device index is listed twice")
        return value


def _component_union(section: str, builtins_only: bool):
    classes = tuple(c for c in registry.kinds(section).values() if not (builtins_only and c.plugin))
    if len(classes) == 1:
        return Annotated[classes[0], Field(discriminator="kind")]
    return Annotated[Union[classes], Field(discriminator="kind")]


PARTIAL_KEYS = ("sources", "rollout", "signal", "objective", "terms", "sync", "train")


class Phase(Strict):
    """A step range of the run with partial overrides of the base spec (its other sections come from spec_model)."""

    until: int = Field(..., ge=1, description="This phase covers steps up to (excluding) this step.")


class Stage(Strict):
    """A stage run after the previous one, a partial spec over the base (its other sections come from spec_model)."""

    name: str = Field(..., pattern=r"^[a-z0-9_-]+$", description="Stage name (used in logs and run folders).")


def _keep(value):
    return value


def _drop_default(schema: dict) -> None:
    schema.pop("default", None)  # a required field made optional for a partial has no default to show


def _partial(model: type[BaseModel], name: str, doc: str, exclude: tuple = (), **over) -> type[BaseModel]:
    """`model` with every field optional (a partial is deep-merged over a full section), for the JSON Schema."""
    fields = {}
    for n, f in model.model_fields.items():
        if n in exclude:
            continue
        if n in over:
            fields[n] = over[n]
        elif f.is_required():
            fields[n] = (f.annotation, FieldInfo.merge_field_infos(f, default=None, json_schema_extra=_drop_default))
        else:
            fields[n] = (f.annotation, f)
    return create_model(name, __base__=Strict, __doc__=doc, **fields)


def _partial_union(section: str, builtins_only: bool):
    """The section's kinds as partials: `kind` may be left out (the base spec's component is patched)."""
    what = section.rstrip("s") if section != "sources" else "source"
    parts = tuple(_partial(c, f"{c.__name__}Partial", f"Partial {c.kind_name()} {what}: merged over the base "
                           f"spec's {what}; a different `kind` replaces it whole. {c.summary()}")
                  for c in registry.kinds(section).values() if not (builtins_only and c.plugin))
    return parts[0] if len(parts) == 1 else Union[parts]


def _as_raw(schema_type, description: str, nullable: bool = False, raw=dict[str, Any]):
    """A phase/stage section: kept as the raw mapping (`raw`; validated after merging, in composer.checks.validate),
    described in the JSON Schema by its partial type.

    nullable: `null` removes the base spec's value (a stage that switches from signal + objective to terms)."""
    schema_type = Optional[schema_type] if nullable else schema_type
    return (Annotated[Optional[raw], BeforeValidator(_keep, json_schema_input_type=schema_type)],
            Field(None, description=description))


def _segment_models(term, builtins_only: bool) -> tuple[type[BaseModel], type[BaseModel]]:
    """Phase and Stage with typed partial sections. Their values stay the raw YAML mappings: validation merges
    each one over the base spec and validates the result with the full model, so only the schema gets types."""
    source_p, guide_p = _partial_union("sources", builtins_only), _partial_union("guide", builtins_only)
    signal_p, objective_p = _partial_union("signal", builtins_only), _partial_union("objective", builtins_only)
    env_p = _partial_union("environment", builtins_only)
    rollout_p = _partial(Rollout, "RolloutPartial", "Partial rollout settings, merged over the base spec's rollout.",
                         guide=(guide_p, Field(None, description="Who else writes tokens into rollouts (partial).")),
                         environment=(env_p, Field(None, description="Who answers the policy between its turns "
                                                   "(partial).")))
    sync_p = _partial(Sync, "SyncPartial", "Partial sync settings, merged over the base spec's sync.")
    train_stage = _partial(Train, "TrainPartial", "Partial train settings, merged over the base spec's train.")
    train_phase = _partial(Train, "PhaseTrainPartial", "Partial train settings of a phase (not `steps`: phases "
                           "split the spec's train.steps with `until`).", exclude=("steps",))
    sections = {
        "sources": _as_raw(dict[str, source_p], "Sources added, or merged over the base spec's sources of the same "
                           "name (a different `kind` replaces one whole)."),
        "rollout": _as_raw(rollout_p, "Rollout settings merged over the base spec's."),
        "signal": _as_raw(signal_p, "The signal, merged over the base spec's (a different `kind` replaces it; "
                          "null removes it).", nullable=True),
        "objective": _as_raw(objective_p, "The objective, merged over the base spec's (a different `kind` replaces "
                             "it; null removes it).", nullable=True),
        "terms": _as_raw(list[_partial(term, "TermPartial", "A term of a phase or stage: a whole signal/objective "
                                       "pair, or `{name, ...}` patching the base spec's term of that name.")],
                         "Weighted signal/objective pairs: when every entry names a term of the base spec, those "
                         "terms are patched (merged) and the others kept; otherwise the list replaces the base "
                         "spec's terms whole (null removes them).", nullable=True, raw=list[Any]),
        "sync": _as_raw(sync_p, "Sync settings merged over the base spec's."),
    }
    phase = create_model("Phase", __base__=Phase, __doc__="A step range with partial overrides of the base spec.",
                         **sections, train=_as_raw(train_phase, "Train settings merged over the base spec's (not "
                                                   "`steps`)."))
    stage = create_model("Stage", __base__=Stage, __doc__="A stage: a partial spec over the base, run after the "
                         "previous stage.", **sections,
                         train=_as_raw(train_stage, "Train settings merged over the base spec's; `steps` is this "
                                       "stage's step count."))
    return phase, stage


_CACHE: dict = {}


def spec_model(builtins_only: bool = False) -> type[BaseModel]:
    """Build the Spec model from the registry (rebuilt when plugins add kinds)."""
    key = (builtins_only,) + tuple((s, tuple(registry.kinds(s))) for s in registry.SECTIONS)
    if key in _CACHE:
        return _CACHE[key]
    source_u, guide_u = _component_union("sources", builtins_only), _component_union("guide", builtins_only)
    signal_u, objective_u = _component_union("signal", builtins_only), _component_union("objective", builtins_only)
    none_guide = registry.lookup("guide", "none")
    env_u, none_env = _component_union("environment", builtins_only), registry.lookup("environment", "none")

    rollout = create_model(
        "Rollout", __base__=Rollout,
        guide=(guide_u, Field(default_factory=none_guide, description="Who else writes tokens into rollouts.")),
        environment=(env_u, Field(default_factory=none_env, description="Who answers the policy between its turns: "
                                  "none (default: one policy turn), tools (declared tools answer Hermes-format tool "
                                  "calls), or a plugin's kind (reset / step with text in and out).")),
    )
    term = create_model(
        "Term", __base__=Strict,
        signal=(signal_u, Field(..., description="Where the learning signal comes from.")),
        objective=(objective_u, Field(..., description="How the signal becomes a loss.")),
        weight=(ScheduledNumber, Field(1.0, description="Weight of this term in the summed loss: a number or a schedule ({kind: linear|cosine|step, start, end, steps, begin}) resolved per step.")),
        name=(Optional[Name], Field(None, description="Name used when logging this term, [a-z0-9_-]+ (default: term<i>).")),
        gate=(Optional[Gate], Field(None, description="Train this term only on the rows a predicate of the rollout selects (outcome, group success rate, a successful sibling, entropy quantile); rows outside get no loss from it and do not count in its normaliser.")),
    )
    phase, stage = _segment_models(term, builtins_only)
    model = create_model(
        "Spec", __base__=Strict,
        name=(str, Field(..., pattern=NAME_PATTERN, description="Method name, [a-z0-9_-]+.")),
        summary=(str, Field("", description="One line saying what the method does.")),
        extends=(Optional[str], Field(None, description="Path (relative to this file) of a spec to deep-merge over.")),
        plugins=(list[str], Field(default_factory=list, description="Modules to import for third-party components, named explicitly; imported only when the person running the command allows it (--allow-plugins or COMPOSER_ALLOW_PLUGINS=1).")),
        policy=(Policy, Field(default_factory=Policy, description="The trained model.")),
        data=(Data, Field(default_factory=Data, description="Training and evaluation data.")),
        sources=(dict[Name, source_u], Field(default_factory=dict, json_schema_extra={"additionalProperties": False},
                                             description="Privileged-information sources, by name ([a-z0-9_-]+, like `name`: names reach logs and diagrams).")),
        rollout=(rollout, Field(default_factory=rollout, description="How responses are sampled.")),
        signal=(Optional[signal_u], Field(None, description="Where the learning signal comes from.")),
        objective=(Optional[objective_u], Field(None, description="How the signal becomes a loss.")),
        terms=(Optional[list[term]], Field(None, description="Several weighted signal/objective pairs, instead of `signal` + `objective`.")),
        sync=(Sync, Field(default_factory=Sync, description="When rollout weights are refreshed from the trainer.")),
        phases=(list[phase], Field(default_factory=list, description="Step ranges with partial overrides, e.g. a guide switched off after step 200.")),
        stages=(list[stage], Field(default_factory=list, description="Stages run one after another, each a partial spec with its own train.steps.")),
        train=(Train, Field(default_factory=Train, description="Optimisation and run settings.")),
    )
    _CACHE[key] = model
    return model

