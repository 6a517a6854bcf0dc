"""OpenRLHF's reward plugin (`--reward.remote_url reward.py`) over the composer's registered verifiers.

OpenRLHF calls `reward_func(queries, prompts, labels)` inside the vLLM engine actors, one sample per
call; `queries` are prompt + response decoded with special tokens, so the response is the query minus
the prompt, with the tokenizer's special tokens stripped before the verifier reads it.
"""

from __future__ import annotations

from composer.backends.openrlhf.batch import decode_label, example_of


class RewardError(LookupError):
    """The reward function cannot be built here (a verifier this process does not know)."""


def import_plugins(modules) -> None:
    """Import the plugin modules the bundle ships (their verifiers register on import); RewardError if one fails."""
    import importlib

    for name in modules:
        try:
            importlib.import_module(name)
        except Exception as e:  # noqa: BLE001 - any import failure is the same clear message
            raise RewardError(f"reward.py: plugin module '{name}' does not import here: {type(e).__name__}: {e} "
                              "(the bundle carries it next to composer/; what it imports must be installed on every "
                              "node)") from None


def verifier_function(verifier: str, plugins=()):
    """The registered verifier `verifier` ('none': None), after importing the bundle's `plugins`; RewardError
    naming it and what is registered when it is not."""
    from composer import registry

    registry.load_all()
    import_plugins(plugins)
    if verifier == "none":
        return None
    info = registry.VERIFIERS.get(verifier)
    if info is None:
        known = ", ".join(sorted(registry.VERIFIERS)) or "none at all"
        raise RewardError(f"reward.py: verifier '{verifier}' is not registered in this process (registered: "
                          f"{known}); a plugin's verifier needs its module in the bundle (composer compile ships "
                          "the plugin modules the spec names) or installed on every node")
    return info.load()


def make_reward_func(verifier: str, tokenizer: str | None = None, threshold: float = 0.5,
                     trust_remote_code: bool = False, plugins=()):
    """`reward_func(queries, prompts, labels)` scoring with the composer verifier `verifier` ('none': 0).
    `trust_remote_code` (the spec's policy.trust_remote_code) is passed to the tokenizer explicitly; `plugins`
    (the modules the bundle ships) are imported first, so a plugin's verifier is registered."""
    verify = verifier_function(verifier, plugins)
    specials: list[str] = []

    def special_tokens() -> list[str]:
        if not specials and tokenizer:
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(tokenizer, trust_remote_code=bool(trust_remote_code))
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
