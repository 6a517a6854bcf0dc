"""Stand-in for vLLM (GPU only): the names OpenRLHF imports at module level."""

from dataclasses import dataclass, field

__version__ = "0.29.0"  # the version OpenRLHF 0.11.2's [vllm] extra pins


@dataclass
class SamplingParams:
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_tokens: int = 0
    skip_special_tokens: bool = True
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    seed: int | None = None
    stop_token_ids: list | None = None  # besides the eos of the tokenizer and generation_config (vLLM's own)
    extra: dict = field(default_factory=dict)
