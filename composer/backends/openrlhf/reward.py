"""OpenRLHF's reward plugin (`--reward.remote_url reward.py`) over the composer's registered verifiers.

OpenRLHF calls `reward_func(queries, prompts, labels)` inside the vLLM engine actors, one sample per
call; `queries` are prompt + response decoded with special tokens, so the response is the query minus
the prompt, with the tokenizer's special tokens stripped before the verifier reads it.
"""

from __future__ import annotations

from composer.backends.openrlhf.batch import decode_label, example_of


def make_reward_func(verifier: str, tokenizer: str | None = None, threshold: float = 0.5):
    """`reward_func(queries, prompts, labels)` scoring with the composer verifier `verifier` ('none': 0)."""
    from composer import registry

    registry.load_all()
    verify = None if verifier == "none" else registry.VERIFIERS[verifier].load()
    specials: list[str] = []

    def special_tokens() -> list[str]:
        if not specials and tokenizer:
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(tokenizer)
            specials.extend(sorted({t for t in tok.all_special_tokens if t}, key=len, reverse=True) or [""])
        return specials

    def response_of(query: str, prompt: str) -> str:
        text = query.removeprefix(prompt)
        for t in special_tokens():
            if t:
                text = text.replace(t, "")
        return text

    def reward_func(queries, prompts, labels):
        """One sample per call in OpenRLHF 0.11.2: scalars out; lists when given several."""
        out = {"rewards": [], "scores": [], "extra_logs": {"composer_parsed": []}}
        for q, p, label in zip(queries, prompts, labels):
            verdict = verify(response_of(q, p), example_of(p, decode_label(label))) if verify else None
            r = float(verdict.reward) if verdict else 0.0
            out["rewards"].append(r)
            out["scores"].append(float(r >= threshold))
            out["extra_logs"]["composer_parsed"].append(float(verdict.parsed) if verdict else 1.0)
        if len(queries) == 1:
            out = {"rewards": out["rewards"][0], "scores": out["scores"][0],
                   "extra_logs": {"composer_parsed": out["extra_logs"]["composer_parsed"][0]}}
        return out

    return reward_func
