"""The run context: what component implementations may use at run time (shared by both backends)."""

from __future__ import annotations

import copy
import random
from dataclasses import dataclass, field
from typing import Any

import torch

from composer.contract import Runtime
from composer.data import Example, Task
from composer.runtime.engine import RolloutEngine, Sampling


@dataclass
class DataCursor:
    """Which training prompts come next: the rows in a seeded order per epoch, this rank's slice of every
    global batch, and the position a checkpoint keeps (`pos`)."""

    task: Task
    seed: int = 0
    rng: random.Random = field(default_factory=random.Random)  # data order and guide decisions
    pos: int = 0
    rank: int = 0  # this process's rank and the number of ranks (DDP): prompts are split by rank
    world: int = 1
    orders: dict = field(default_factory=dict)  # (epoch, rows) -> that epoch's shuffled row order

    def next_prompts(self, n: int) -> list[Example]:
        """This rank's n prompts of the step: every rank draws the same global batch of n x world prompts
        (same seed, same position) and takes its own slice, so prompts are split by rank and each prompt's
        group stays whole on one rank; with one process, simply the next n."""
        every = self._draw(n * self.world)
        return every[self.rank * n:(self.rank + 1) * n]

    def _draw(self, n: int) -> list[Example]:
        if self.task.sample_train is not None:
            return self.task.sample_train(self.rng, n)
        size = len(self.task.train)
        out = []
        for _ in range(n):
            epoch, i = divmod(self.pos, size)
            out.append(self.task.train[self.epoch_order(epoch)[i]])
            self.pos += 1
        return out

    def epoch_order(self, epoch: int) -> list[int]:
        """The shuffled order of the training rows in `epoch`: a function of the seed and the epoch alone, so
        the data position (`pos`, kept in every checkpoint) is all a resumed run needs to draw exactly
        the prompts an uninterrupted run draws, mid-epoch included."""
        key = (epoch, len(self.task.train))
        if key not in self.orders:
            order = list(range(len(self.task.train)))
            random.Random(self.seed + epoch * len(self.task.train)).shuffle(order)
            for old in [k for k in self.orders if k[0] < epoch - 1]:
                del self.orders[old]  # an epoch before the previous one is never drawn again
            self.orders[key] = order
        return self.orders[key]

    def peek_prompts(self, n: int) -> list[Example]:
        """The next n training prompts, without moving the data position or the data RNG (the prompts the
        next steps will draw)."""
        state = (self.rng.getstate(), self.pos)
        try:
            return self.next_prompts(n)
        finally:
            self.rng.setstate(state[0])
            self.pos = state[1]


@dataclass
class ModelServer:
    """The weights a run holds and the tokenizer they read: the trained policy (live), the rollout engine that
    samples with its copy, the frozen initial weights, the torch.compile wrappers."""

    tokenizer: Any
    policy: torch.nn.Module | None
    engine: RolloutEngine | None
    initial: torch.nn.Module | None = None  # built on first use (`initial_policy`)
    compiled: dict = field(default_factory=dict)  # id(model) -> its torch.compile wrapper

    def initial_policy(self) -> torch.nn.Module:
        """The frozen reference weights ("initial"): a copy of the policy at the start of the run, refreshed
        at each stage's start unless train.reference is run_start (`refresh_initial`)."""
        if self.initial is None:
            from composer.runtime.models import AdapterOff, has_adapter

            # a LoRA policy's initial weights are its base model: the adapter off, no copy
            self.initial = AdapterOff(self.policy) if has_adapter(self.policy) else \
                copy.deepcopy(self.policy).eval().requires_grad_(False)
        return self.initial

    def restore_initial(self, state: dict) -> None:
        """The frozen reference weights of a checkpoint (a LoRA policy's base needs none: {} is kept)."""
        from composer.runtime.models import has_adapter, merged

        if state and has_adapter(self.policy):  # a later stage's merged copy
            self.initial = merged(self.policy).eval().requires_grad_(False)
        self.initial_policy().load_state_dict(state)

    def refresh_initial(self) -> None:
        """The reference weights become the policy's current weights (the start of a stage)."""
        from composer.runtime.models import AdapterOff, merged

        if isinstance(self.initial, AdapterOff):  # a LoRA policy's later stage: a merged copy of its weights now
            self.initial = merged(self.policy).eval().requires_grad_(False)
        elif self.initial is not None:
            self.initial.load_state_dict(self.policy.state_dict())

    def forward_model(self, model: torch.nn.Module, compile: bool):
        """`model` for log-prob forward passes: compiled once when `compile` (train.compile) is set (the
        wrapper shares the weights; checkpoints keep saving the plain module)."""
        if not compile:
            return model
        if id(model) not in self.compiled:
            self.compiled[id(model)] = torch.compile(model, dynamic=True)
        return self.compiled[id(model)]


@dataclass
class MetricsSink:
    """Where a step reports: its scalars (`metrics`, reset every step), the run's cumulative token costs,
    and the recorder of events (tests, conformance checks: recorder(kind, **data))."""

    metrics: dict = field(default_factory=dict)
    # policy_samples: every sequence the policy network wrote (composer/runtime/rollout.py `count_samples`)
    costs: dict = field(default_factory=lambda: {"policy_tokens": 0, "judge_tokens": 0, "teacher_tokens": 0,
                                                 "policy_samples": 0})
    recorder: Any = None


@dataclass
class Memo:
    """What components keep for the whole run, one named table each (`ctx.memo`). A component's table is keyed by
    its configuration's JSON, so segments with one configuration share it. The prefix searches (`prefixes`,
    `prefix_traces`) are kept in checkpoints: a resumed run does not search again."""

    prompt_formats: dict = field(default_factory=dict)  # (id(tokenizer), data settings JSON) -> PromptFormat
    servers: dict = field(default_factory=dict)  # id(frozen initial weights) -> the LocalModel serving them
    judges: dict = field(default_factory=dict)  # (source name, source JSON, guide JSON) -> its judge
    token_texts: dict = field(default_factory=dict)  # token id -> its text alone (splitting steps)
    prefixes: dict = field(default_factory=dict)  # prefix guide JSON -> {problem prompt: k of the minimal search}
    prefix_traces: dict = field(default_factory=dict)  # prefix guide JSON -> {problem prompt: accepted trace text}
    targets: dict = field(default_factory=dict)  # (segment, signal JSON) -> {problem prompt: [target traces]}

    def checkpointed(self) -> dict:
        """The tables a checkpoint keeps, as {repr(key): value} with the keys of earlier checkpoints."""
        out = {repr(("guide", "prefix-search", k)): v for k, v in self.prefixes.items()}
        out.update({repr(("guide", "prefix-search", "traces", k)): v for k, v in self.prefix_traces.items()})
        return out

    def restore(self, key: tuple, value) -> None:
        """One entry of `checkpointed` back (its key read back as a tuple)."""
        if key[:3] == ("guide", "prefix-search", "traces"):
            self.prefix_traces[key[3]] = value
        elif key[:2] == ("guide", "prefix-search"):
            self.prefixes[key[2]] = value


@dataclass
class RunState:
    """What a run keeps between steps for its components: their built runtimes, their memo (prefix search,
    token texts, prompt formats), the stored batches of the current sync interval (sync.reuse) and, on
    resume, the checkpointed runtime states waiting for their runtime to be built."""

    runtimes: dict = field(default_factory=dict)  # (kind, name, config) -> built runtime of a component
    memo: Memo = field(default_factory=Memo)  # per-run tables of components
    buffer: list | None = None  # stored batches of the current sync interval
    buffer_version: int = -1  # the sync step the buffer was sampled after
    pending_runtime_state: dict = field(default_factory=dict)  # resumed run: runtime states by key


class RunContext:
    """What component implementations may use at run time (shared by both backends): the segment in force
    and four parts, `data` (DataCursor), `models` (ModelServer), `sink` (MetricsSink) and `state` (RunState).
    Components read the names below (task, tokenizer, policy, engine, costs, metrics, memo, spec, step,
    segment) and call its methods; they import nothing from composer.runtime."""

    def __init__(self, task: Task, tokenizer: Any, policy: torch.nn.Module | None, engine: RolloutEngine | None,
                 spec: Any = None, segment: str = "main", step: int = 0, seed: int = 0,
                 rng: random.Random | None = None, recorder: Any = None, run_dir: Any = None, rank: int = 0,
                 world: int = 1):
        self.spec = spec  # the resolved spec of the current segment
        self.segment = segment
        self.segment_start = self.segment_end = 0  # the steps [start, end) of the segment in force
        self.step = step
        self.run_dir = run_dir  # the run folder (files a component keeps there, e.g. InT's offline targets)
        self.data = DataCursor(task, seed, rng if rng is not None else random.Random(), rank=rank, world=world)
        self.models = ModelServer(tokenizer, policy, engine)
        self.sink = MetricsSink(recorder=recorder)
        self.state = RunState()
        if spec is not None and tokenizer is not None:  # the policy's stop tokens, unless the run bound them
            from composer.stops import for_spec

            for_spec(tokenizer, spec, again=False)

    # ---- what components read ----
    @property
    def task(self) -> Task:
        return self.data.task

    @property
    def tokenizer(self):
        return self.models.tokenizer

    @property
    def policy(self) -> torch.nn.Module:
        return self.models.policy

    @property
    def engine(self) -> RolloutEngine:
        return self.models.engine

    @property
    def costs(self) -> dict:
        return self.sink.costs

    @property
    def metrics(self) -> dict:
        """The scalars of the current step (the step swaps it per term, so it is settable)."""
        return self.sink.metrics

    @metrics.setter
    def metrics(self, value: dict) -> None:
        self.sink.metrics = value

    @property
    def memo(self) -> Memo:
        """The run's tables of what components keep (prefix searches, judges, token texts, built targets)."""
        return self.state.memo

    # ---- text ----
    def prompt_ids(self, example: Example) -> list[int]:
        """The token ids of the policy's prompt for `example`: its rendered prompt text (chat template and
        all, rendered once when the data was bound), tokenized once; the response's ids follow these."""
        return self.encode(example.prompt)

    def prompt_format(self, tokenizer=None):
        """How prompts are rendered for `tokenizer` (default: the policy's) under the spec's data settings: the
        teachers' and judges' privileged prompts use it, as the policy's prompts did (composer/prompts.py)."""
        from composer.prompts import prompt_format

        tok = self.tokenizer if tokenizer is None else tokenizer
        data = getattr(self.spec, "data", None)
        key = (id(tok), None if data is None else data.model_dump_json())
        if key not in self.memo.prompt_formats:
            name = getattr(tok, "name_or_path", "") or ""
            self.memo.prompt_formats[key] = prompt_format(data, tok, name)
        return self.memo.prompt_formats[key]

    def encode(self, text: str) -> list[int]:
        """Token ids of a rendered prompt or of response text: no special tokens added (a chat template
        writes its own; a BOS is never doubled)."""
        return self.tokenizer.encode(text, add_special_tokens=False)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    @property
    def stops(self):
        """The policy's stop tokens (composer/stops.py StopTokens): every id that ends a response, and the end token."""
        from composer.stops import of

        return of(self.tokenizer)

    @property
    def stop_ids(self) -> tuple[int, ...]:
        """Every token id that ends a response (the tokenizer's eos, generation_config's eos_token_id, the chat
        template's end of turn under chat prompts): a response ending in one of them is finished."""
        return self.stops.ids

    @property
    def eos_id(self) -> int:
        """The token a target the run writes ends with (an SFT demonstration, a judge's whole answer): the chat
        template's end of turn under chat prompts, else the tokenizer's eos (composer/stops.py)."""
        return self.stops.end

    @property
    def pad_id(self) -> int:
        return self.tokenizer.pad_token_id

    @property
    def max_new_tokens(self) -> int:
        cap = self.task.max_new_tokens
        n = self.spec.rollout.max_new_tokens
        return min(n, cap) if cap else n

    @property
    def sampling(self) -> Sampling:
        r = self.spec.rollout
        return Sampling(temperature=r.temperature, top_p=r.top_p, top_k=r.top_k)

    # ---- data ----
    def next_prompts(self, n: int) -> list[Example]:
        return self.data.next_prompts(n)

    def peek_prompts(self, n: int) -> list[Example]:
        return self.data.peek_prompts(n)

    # ---- components ----
    def source(self, name: str):
        """The built runtime of source `name` in the current segment (built once per config)."""
        cfg = self.spec.sources[name]
        key = ("source", name, cfg.model_dump_json())
        if key not in self.state.runtimes:
            rt = cfg.build(self, name)
            state = self.state.pending_runtime_state.get(repr(key))
            if state and isinstance(rt, Runtime):  # resumed run: the checkpointed runtime state
                from composer.runtime.checkpoint import restore_runtime

                restore_runtime(rt, state, repr(key), self.run_dir)
            self.state.runtimes[key] = rt
        return self.state.runtimes[key]

    def critic(self, term: str, cfg):
        """The built runtime of term `term`'s critic (a `value_model()` config, components/objectives/critic.py),
        built when first used; a resumed run's checkpointed state is loaded into it. A critic of the same term and
        network built under other settings (a later phase or stage that changes its lr or value_clip,
        train.critic_at_stage: keep) is carried on under the new settings; `reset_critics` drops them all."""
        key = ("critic", term, cfg.model_dump_json())
        if key not in self.state.runtimes:
            same = [k for k, rt in self.state.runtimes.items() if k[:2] == ("critic", term)
                    and getattr(rt, "cfg", None) is not None and rt.cfg.network == cfg.network
                    and rt.cfg.model == cfg.model and rt.cfg.trust_remote_code == cfg.trust_remote_code]
            if same:
                rt = self.state.runtimes.pop(same[0])
                rt.cfg = cfg
                self.state.runtimes[key] = rt
        if key not in self.state.runtimes:
            rt = cfg.build(self, term)
            state = self.state.pending_runtime_state.get(repr(key))
            if state and isinstance(rt, Runtime):
                from composer.runtime.checkpoint import restore_runtime

                restore_runtime(rt, state, repr(key), self.run_dir)
            self.state.runtimes[key] = rt
        return self.state.runtimes[key]

    def reset_critics(self) -> None:
        """Every critic starts afresh when next used (a stage's start with train.critic_at_stage: reset): the built
        critics and any checkpointed critic state waiting for them are dropped."""
        for k in [k for k in self.state.runtimes if k[0] == "critic"]:
            del self.state.runtimes[k]
        for k in [k for k in self.state.pending_runtime_state if k.startswith("('critic',")]:
            del self.state.pending_runtime_state[k]

    def critic_values(self, term: str, objective, batch) -> torch.Tensor:
        """[B, T] the values of term `term`'s critic on `batch` before the step's update (no gradient)."""
        from composer.runtime.critic import critic_values

        return critic_values(self, term, objective, batch)

    def verifier(self, name: str):
        from composer.registry import VERIFIERS

        name = self.task.verifier if name == "auto" else name
        if name not in VERIFIERS:
            raise KeyError(f"verifier '{name}' is not registered (known: {', '.join(sorted(VERIFIERS))})")
        return VERIFIERS[name].load()

    def initial_policy(self) -> torch.nn.Module:
        return self.models.initial_policy()

    def initial_logprobs(self, batch) -> torch.Tensor:
        """[B, T] log-probs of the batch under the frozen initial weights (a KL term, A*PO's anchor)."""
        from composer.runtime.models import batch_logprobs

        return batch_logprobs(self.forward_model(self.initial_policy()), batch)

    def old_entropy(self, batch) -> torch.Tensor:
        """[B, T] the entropy of the policy's next-token distribution at each token under the weights now: in the
        step's part 2, before its first update, the old policy's (an entropy token selection: grpo's entropy, archer)."""
        from composer.runtime.models import batch_entropy

        return batch_entropy(self.forward_model(self.policy), batch)

    def forward_model(self, model: torch.nn.Module):
        """`model` for log-prob forward passes: compiled once when train.compile is set."""
        return self.models.forward_model(model, self.spec is not None and self.spec.train.compile)

    def model_server(self, model: str):
        """What serves protocol requests for `model`: "policy" (the rollout engine), "initial" (the frozen
        initial policy) or the name of a policy_model source (its own weights, or the engine/initial for `self`)."""
        from composer.runtime.engine import LocalModel
        from composer.protocol import INITIAL, POLICY

        if model == POLICY:
            return self.engine
        if model == INITIAL:
            key = id(self.initial_policy())
            if key not in self.memo.servers:
                self.memo.servers[key] = LocalModel(self.initial_policy(), self.tokenizer)
            return self.memo.servers[key]
        return self.source(model).server(self)

    # ---- services: what components call in the runtime (components import nothing from composer.runtime) ----
    def run(self, programs: list) -> list:
        """Run protocol programs (composer/protocol.py) to completion against this run's models; their return
        values, in order."""
        from composer.runtime.rollout import run

        return run(self, programs)

    def rollout(self, guide, examples: list, n: int):
        """n rollouts per example written by `guide`, as a TrajectoryBatch (composer/runtime/rollout.py)."""
        from composer.runtime.rollout import rollout

        return rollout(self, guide, examples, n)

    def resolve_model(self, name: str) -> str:
        """The local directory of model `name` (an id, a path, or a toy testbed name)."""
        from composer.runtime.models import resolve

        return resolve(name)

    def load_model(self, name: str, dtype: str = "float32", trust_remote_code: bool = False):
        """A causal LM from `name` (resolved); ModelLoadError (composer.errors) when it does not load."""
        from composer.runtime.models import load_model

        return load_model(self.resolve_model(name), dtype, trust_remote_code=trust_remote_code)

    def load_tokenizer(self, name: str, trust_remote_code: bool = False):
        """The tokenizer of `name` (resolved); ModelLoadError (composer.errors) when it does not load."""
        from composer.runtime.models import load_tokenizer

        return load_tokenizer(self.resolve_model(name), trust_remote_code=trust_remote_code)

    def value_model(self, name: str | None, dtype: str = "float32", trust_remote_code: bool = False, seed: int = 0):
        """A value model with one scalar output per position: from `name` (resolved; a causal LM gets a fresh head),
        or with `name` None initialised from the policy's weights (composer/runtime/models.py, value_model_from)."""
        from composer.runtime.models import load_value_model, value_model_from

        if name is None:
            return value_model_from(self.policy, seed)
        return load_value_model(self.resolve_model(name), dtype, trust_remote_code, seed)

    def value_head(self, seed: int = 0):
        """A fresh scalar head over the policy's hidden states (a critic sharing the policy's network)."""
        from composer.runtime.models import policy_head

        return policy_head(self.policy, seed)

    def load_scorer(self, name: str, dtype: str = "float32", trust_remote_code: bool = False):
        """A trained sequence-regression model (a reward model: one output, its `score` head in the checkpoint)."""
        from composer.runtime.models import load_scorer

        return load_scorer(self.resolve_model(name), dtype, trust_remote_code)

    def token_scores(self, model, tokens, attention_mask):
        """[B, T] a sequence-regression model's scalar head at every position (on the model's device, returned on
        the tokens' device)."""
        from composer.runtime.models import token_scores

        device = next(model.parameters()).device
        return token_scores(model, tokens.to(device), attention_mask.to(device)).to(tokens.device)

    def last_hidden(self, model, tokens, attention_mask):
        """[B, T, H] the last hidden state of `model`'s backbone (a head on the policy's network)."""
        from composer.runtime.models import last_hidden

        device = next(model.parameters()).device
        return last_hidden(model, tokens.to(device), attention_mask.to(device)).to(tokens.device)

    def lr_scale(self) -> float:
        """The Plan's learning-rate factor of the step in force (warm-up and decay of train, per segment): a second
        optimizer (a critic's) follows the policy's program at its own base rate."""
        from composer.plan.schedule import LR

        t = self.spec.train
        length = max(self.segment_end - self.segment_start, 1)
        return LR(1.0, t.warmup_steps, t.lr_schedule).at(self.step - self.segment_start, length)

    def serve(self, model: torch.nn.Module, tokenizer):
        """A model server (generate / score, the interface of the rollout engine) over local weights."""
        from composer.runtime.engine import LocalModel

        return LocalModel(model, tokenizer)

    def record(self, kind: str, **data) -> None:
        """Report an event of what ran to the recorder, when one is installed (tests, conformance checks)."""
        if self.sink.recorder is not None:
            self.sink.recorder(kind, step=self.step, segment=self.segment, **data)

    def log(self, **values: float) -> None:
        self.sink.metrics.update({k: float(v) for k, v in values.items()})
