"""The backend-neutral component contract (DESIGN.md section 8): one base class per section, every
optional hook declared here with its default, so backends call hooks and never probe with getattr.

  Source     preflight(ctx, name)      checks before any training (tokenizers, paths)
             build(ctx, name)          the runtime a run uses (default: the config itself)
             text(ctx, batch, i)       privileged text for row i (text sources), None when it has none
             teacher_prompts / score_tokens   a teacher's privileged prompts and its scores of the student's
                                       tokens with the backend's forward (both backends)
  Runtime    after_optimizer_step(ctx), state_dict(), load_state_dict(state)
  Guide      writes                    the token origins it writes into rollouts
             prepare(ctx, examples)    a program run once per step before the rollouts (searches, caches)
             row(ctx, example, i, n)   the program of one rollout (composer/protocol.py)
             reads()                   its own model calls and the weights they read (the Plan's schedule)
             preflight(ctx), metrics(traces)
  Signal     origins(guide)            the token origins of the batch this signal's term trains on
             makes_batch / make_batch  a signal whose batch is not a rollout (SFT on references)
             apply(ctx, batch)         fill rewards / teacher log-probs / targets
             row_target(ctx, ex, trace) the same for one row (OpenRLHF), as a program
             builds_ahead / start(ctx) batches built once when the segment begins (InT offline);
             ahead_program / ahead_targets  the same, row by row (OpenRLHF's agent)
             rollouts_ahead(spec, steps) the rollouts that build costs before it runs (the bench's budget)
             teacher_source            the policy_model source it reads log-probs from
  Objective  components/objectives/base.py: advantages(batch) over whole groups, then
             loss(batch, view, advantages) per micro-batch
  Environment active                   whether rollouts alternate policy and environment turns
             session()                 one episode's environment: reset(example) -> text, step(text) -> (text,
                                       reward or None, done); pure text, no backend object (composer/episodes.py
                                       drives it on both backends)
             stop_strings(), render_plain(text), role   how a policy turn ends and how an answer is shown
             reference_replies(example, turns)          the referee's replay of the environment's answers
             preflight(ctx)

Nothing here imports torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, final

from pydantic import Field

from composer.registry import Component


@dataclass(frozen=True)
class ModelCall:
    """A generation a guide asks of a model other than the rollout itself (a model judge): what backends size
    engine contexts by. `weights` is the source's weights (`current`, `initial`, `ema`); `sampled`: the model
    samples (at the rollout's sampling settings), not greedy (a judge's verdict)."""

    source: str
    answer_tokens: int
    step_split: str
    weights: str = "current"
    sampled: bool = False


class Runtime:
    """What a source's `build` returns when it holds state through a run (weights, caches)."""

    def after_optimizer_step(self, ctx) -> None:
        """After every optimiser step (EMA teachers)."""

    def state_dict(self) -> dict:
        """What a checkpoint must keep to continue exactly (tensors and plain data)."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Restore what `state_dict` returned."""


class Source(Component):
    """Base of every privileged-information source."""

    pi: ClassVar[str] = "prior"  # prior: usable without the environment; posterior: needs it
    scored_by_model: ClassVar[bool] = False  # its rewards are a model's scores (the referee rescores its checkpoint)
    decides_success: ClassVar[bool] = False  # its verdicts say which rollouts succeeded (a spec's default for gates)

    def openrlhf_reward_part(self, weight: float, response_cap: int) -> dict | None:
        """The engine mapping of this source as a `plus` part of a reward signal (DESIGN.md section 11): OpenRLHF's
        flags that add it to every sample's reward, {"flags": [(flag, *values)], "note": words}, or
        {"refused": why, "hint": fix} for a setting its flags cannot carry; None: no flag adds it (a second reward,
        which OpenRLHF's one reward function per sample cannot carry)."""
        return None

    def preflight(self, ctx, name: str) -> None:
        """Checks that must fail before any training (nothing by default)."""

    @property
    def wants_initial(self) -> bool:
        """Reads the frozen initial policy (a `weights: initial` self-teacher or judge); False by default."""
        return False

    @property
    def model_path(self) -> str | None:
        """The model this source loads (a path, an id, `self` or a `toy:` name); None for a source without one."""
        return None

    @property
    def needs_step_checker(self) -> bool:
        """Works only on a task with a programmatic step checker (the toy testbed's oracle); False by default."""
        return False

    def build(self, ctx, name: str):
        """The runtime object of this source in a run (the config itself by default)."""
        return self

    def short_run_overrides(self) -> list[str]:
        """Overrides the referee's short run on the toy testbed needs for this source to act (none by default)."""
        return []

    def reference_rewards(self, lengths: list[int], response_cap: int) -> list[float] | None:
        """The referee's rewards of a source that computes them from the rows' response lengths alone (DESIGN.md
        section 10), written again plainly: `lengths` [B] response tokens, `response_cap` the cap generation ran
        under. None (the default): not such a source; the referee reads a verifier's recorded verdicts or rescores
        with a reward model's checkpoint, and a source that is neither is "not covered"."""
        return None

    def text(self, ctx, batch, i: int) -> str | None:
        """Privileged text for row i of `batch` (text sources only)."""
        raise TypeError(f"a {self.kind_name()} source has no text")

    def example_text(self, example) -> str | None:
        """Privileged text of the problem alone (usable mid-rollout): a source whose text depends on the
        problem only overrides this (the override is what declares it)."""
        raise TypeError(f"a {self.kind_name()} source has no per-problem text")

    def teacher_prompts(self, ctx, name: str, batch) -> list:
        """As a teacher shown privileged context: (its prompt's token ids, or None for the student's own prompt;
        the row's weight, 0 when the declared context has no text for it) per row of `batch` (whole groups: a
        context may read a row's siblings). Only a source that scores as a teacher has them."""
        raise TypeError(f"a {self.kind_name()} source is no teacher")

    def score_tokens(self, forward_logits, tokens, attention_mask, prompt_len: list[int], prompts: list,
                     pad_id: int, want_logits: bool):
        """As a teacher: log-probs [B, T] (and logits [B, T, V], or None) of each row's response tokens under its
        prompt (`prompts[i]`, None: the row's own), with the backend's forward pass `forward_logits(ids, mask) ->
        [B, T2, V]`. Only a source that scores as a teacher has them."""
        raise TypeError(f"a {self.kind_name()} source is no teacher")


class Guide(Component):
    """Base of every rollout guide: rollouts are programs of requests (composer/protocol.py)."""

    writes: ClassVar[tuple[str, ...]] = ()  # token origins besides the policy's that it writes
    plain: ClassVar[bool] = False  # True only for plain sampling (no program beyond one continuation)

    def writes_now(self) -> tuple[str, ...]:
        """The origins this configuration writes (a guide may write fewer than its kind can)."""
        return type(self).writes

    def extra_tokens(self, spec, max_solution_tokens: int) -> int:
        """Tokens this guide may add to a rollout beyond prompt + rollout.max_new_tokens (a prefix placed in
        the prompt, judge corrections): backends size contexts with it. 0 by default."""
        return 0

    def model_calls(self, spec) -> list[ModelCall]:
        """Generations this guide asks of models other than the rollout (a model judge); none by default."""
        return []

    def reads(self) -> dict[str, str]:
        """The guide's own model calls besides the rollout and its judges' (`model_calls`), with the weights each
        reads (`initial`, `sampler`): the Plan's schedule records them; none by default."""
        return {}

    def describe(self, spec) -> str:
        """Who writes which tokens besides the policy, in a few words (explain's "what will happen")."""
        return f"the {self.kind_name()} guide writes {', '.join(self.writes_now()) or 'no'} tokens"

    def prepare(self, ctx, examples) -> list:
        """Programs run before the rollouts of `examples` (e.g. a search per problem not searched yet);
        none by default."""
        return []

    def row(self, ctx, example, index: int, n: int):
        """The program of rollout `index` (of n) of `example`; returns a protocol.Trace."""
        raise NotImplementedError

    def preflight(self, ctx) -> None:
        """Checks that must fail before any training, e.g. a judge prompt that drops declared context."""

    def reference_control(self, spec, batch, tokenizer=None) -> list[bool] | None:
        """The referee's control rows of a rollout batch (DESIGN.md section 10): row i (rows prompt by prompt,
        rollout.samples_per_prompt each) is a control rollout, the policy's alone, by the spec, written again from
        the guide's rule and sharing nothing with `row`. None (the default): no reference, so the guide's control
        rows are "not covered" and `composer check` fails."""
        return None

    def metrics(self, traces) -> dict[str, float]:
        """Per-step facts of the finished traces, logged as guide/<name> (nothing by default)."""
        return {}

    @final
    def rollout(self, ctx, examples, n: int):
        """n rollouts per example as a TrajectoryBatch, driven by the run's batching driver (a helper, not a hook:
        the guide's program is `row`)."""
        return ctx.rollout(self, examples, n)


class Signal(Component):
    """Base of every signal: where a term's learning signal comes from."""

    usage: ClassVar[str] = ""  # how it spends privileged information: target, teacher, reward

    @property
    def makes_batch(self) -> bool:
        """True when the term trains on a batch this signal builds itself instead of a rollout."""
        return False

    def openrlhf_trainer(self) -> str | None:
        """The engine mapping (DESIGN.md section 11): the OpenRLHF trainer that runs this signal's batch as it is:
        "ppo" (its own reward from the bundle's verifier, OpenRLHF's PolicyLoss route), "sft" (train_sft on fixed
        demonstrations), or None (the composer's own step in the plugin). The mapping is the class's own: a subclass
        (a plugin that changes the signal) has none unless it declares it."""
        return None

    def origins(self, guide: Guide) -> set[str]:
        """Token origins present in this term's batch: the prompt, the policy's tokens and the guide's."""
        return {"prompt", "policy", *guide.writes_now()}

    def make_batch(self, ctx, examples):
        raise NotImplementedError

    def describe(self, spec) -> str:
        """One line of the step's dataflow for `explain` and plan.json."""
        return f"{self.kind_name()} signal"

    @property
    def teacher_source(self) -> str | None:
        """The policy_model source whose log-probs this signal reads (None: none)."""
        return None

    @property
    def loss_temperature(self) -> float | None:
        """The temperature the objective reads the policy's log-probs at on this signal's batches (logits /
        temperature); None: the rollout's sampling temperature (where the behaviour log-probs were taken).
        Lightning reads it from the batch the signal builds; OpenRLHF sets the actor's temperature to it for
        the training step."""
        return None

    @property
    def builds_ahead(self) -> bool:
        """Builds its batches once, when its segment starts (`start`), not from each step's rollouts (InT's
        offline targets): a backend without such a pass refuses it."""
        return False

    def start(self, ctx) -> None:
        """When a segment that uses this signal begins, before its first step (nothing by default)."""

    def ahead_program(self, ctx, example, index: int, n: int):
        """With `builds_ahead`: the program of attempt `index` (of n) at `example` that may yield a target, returning
        (status, trace) (InT: the guide's attempt, then its target). A backend that builds the targets itself
        (OpenRLHF's agent) runs these and hands the results to `ahead_targets`."""
        raise NotImplementedError(f"{self.kind_name()} builds no batches ahead")

    def ahead_targets(self, examples: list, results: list, n: int) -> tuple[dict, dict]:
        """With `builds_ahead`: ({problem prompt: [target traces]}, counts) from `ahead_program`'s results, n per
        example in order."""
        raise NotImplementedError(f"{self.kind_name()} builds no batches ahead")

    def rollouts_ahead(self, spec, steps: int) -> int:
        """Rollouts `start` samples for a segment of `steps` steps under `spec`, as far as they are known before
        it runs (the bench's budget counts them; what depends on the rollouts, such as InT's proposals and filter
        continuations, is counted as it is sampled: cost/policy_samples). 0 by default."""
        return 0

    @property
    def targets_rows(self) -> bool:
        """Trains on part of each rollout, chosen after it finished (`row_target` returns programs)."""
        return False

    def row_target(self, ctx, example, trace):
        """For backends that build the batch row by row (OpenRLHF's agent): a program returning (trace,
        weight) of the part of a finished rollout this term trains on, or None to train on it as written.
        `apply` does the same over a whole batch (Lightning)."""
        return None

    def preflight(self, ctx) -> None:
        """Checks that must fail before any training (nothing by default)."""

    def apply(self, ctx, batch):
        """Fill what this signal provides into the batch (a term's own view of the rollout)."""
        return batch


class Environment(Component):
    """Base of every rollout environment (`rollout.environment`, DESIGN.md section 11 "Environments"): who answers the
    policy between its turns. An active environment makes a rollout an episode (composer/episodes.py): the policy
    writes a turn (up to a stop string or its end of turn), the environment answers (origin `environment`: never
    loss), until the policy answers without a call, the environment ends the episode, or a budget is reached.

    The environment itself is pure text (no backend object): `session()` returns one episode's state with
    `reset(example) -> str` (text shown before the policy's first turn; '' for none) and
    `step(text) -> (answer text, reward or None, done)`, so the same part runs in the Lightning driver and in
    OpenRLHF's agent function. A user's environment is a kind registered in this section (the plugin route,
    docs/plugins.md): a subclass with its fields and a `session()`.
    """

    active: ClassVar[bool] = False  # False only for `none`: rollouts are one policy turn
    role: ClassVar[str] = "user"  # the chat role of the environment's messages under chat prompts (tools: `tool`)

    def session(self):
        """One episode's environment (reset / step); see the class docstring."""
        raise NotImplementedError(f"environment {self.kind_name()} has no session")

    def stop_strings(self) -> tuple[str, ...]:
        """Text that ends a policy turn besides its end of turn (kept as the turn's last text: the Hermes format's
        `</tool_call>`). None by default: a turn ends at the policy's end of turn or its budget."""
        return ()

    def render_plain(self, text: str) -> str:
        """The environment's answer as it is appended to a plain-text rollout (no chat template). Default: as is."""
        return text

    def describe(self, spec) -> str:
        """What the environment does, in a few words, for `explain`."""
        return f"the {self.kind_name()} environment answers between policy turns"

    def extra_tokens(self) -> int:
        """Tokens the environment may add to a rollout beyond rollout.max_new_tokens (backends size contexts)."""
        return int(getattr(self, "max_env_tokens", 0)) if self.active else 0

    def reference_replies(self, example, turns: list[str]) -> list[tuple[str, float | None, bool]] | None:
        """The referee's replay (DESIGN.md section 10): what the environment answers to the policy's turns `turns`
        (each turn's decoded text), from a fresh session: [(answer, reward, done)] per turn it answered. A kind
        may write its answers again plainly (the tools environment: the calculator); default: a fresh session of
        its own (the environment's answers depend on nothing but the example and the turns)."""
        s = self.session()
        s.reset(example)
        return [s.step(t) for t in turns]

    def short_run_overrides(self) -> list[str]:
        """Overrides the referee's short run on the toy testbed needs for this environment to act (none by default)."""
        return []

    def facts(self, session) -> dict[str, float]:
        """Counts of one finished episode for the step's metrics (env/<name>, averaged per row): the tools
        environment's tool_calls and tool_errors. None by default."""
        return {}

    @property
    def runs_code(self) -> bool:
        """Runs the policy's programs in the code sandbox (validation warns where it is missing; a bundle says so);
        False by default."""
        return False

    def preflight(self, ctx) -> None:
        """Checks that must fail before any training (a tool's sandbox); nothing by default."""

    def capabilities(self):
        """An active environment needs a backend that runs episodes (composer/capabilities.py `episodes`)."""
        from composer.capabilities import Capabilities, Need

        return Capabilities(on_policy_only=False, needs=(Need("episodes", ("kind",)),) if self.active else ())


class EpisodeEnvironment(Environment):
    """An active environment with the episode's limits (the base of `tools` and of a user's environment kind)."""

    active: ClassVar[bool] = True
    turn_rewards: ClassVar[bool] = True  # its step may return a reward (False: never; turn_reward_weight cannot act)
    max_turns: int = Field(4, ge=1, le=64, description="Most policy turns per episode: after the last one the episode ends, answered or not (a tool call in it is not executed).")
    max_env_tokens: int = Field(256, ge=0, le=65536, description="Most environment tokens per episode (the sum of its answers as rendered): an answer that would pass it ends the episode instead (counted in env/ended_env_budget). Contexts are sized prompt + rollout.max_new_tokens + this.")
    turn_reward_weight: float = Field(0.0, description="Per-turn rewards the environment returns (step's reward) are summed over the episode, times this weight, into the row's reward (0: ignored; the tools environment returns none).")
