"""A real-format model and data set, built by the test in a temporary folder (nothing is downloaded).

    tokenizer/   a byte-level BPE trained here with `tokenizers`, special tokens <|endoftext|> (BOS, pad),
                 <|im_start|>, <|im_end|> (EOS), and a ChatML chat template (BOS first, add_generation_prompt)
    model/       a random Qwen3-architecture causal LM (about 250k parameters) with that tokenizer
    plain/       the same tokenizer without a chat template (prompt_format auto -> plain)
    train.jsonl, eval.jsonl   small-sum word problems: problem, answer, solution ending in \\boxed{answer}

`build(root)` takes a few seconds; `built(tmp_path_factory)` builds it once per session, for a test module's
fixture:

    @pytest.fixture(scope="module")
    def real(tmp_path_factory):
        return realmodel.built(tmp_path_factory)
"""

from __future__ import annotations

import json
import random
from pathlib import Path

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
SYSTEM = "You are a careful assistant."
INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."


def problem_row(a: int, b: int) -> dict:
    c = a + b
    return {"problem": f"Tom has {a} apples and buys {b} more. How many apples does he have?", "answer": str(c),
            "solution": f"He starts with {a} apples.\nHe buys {b} more, so {a} + {b} = {c}.\n"
                        f"The answer is \\boxed{{{c}}}."}


def rows(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    return [problem_row(rng.randrange(1, 20), rng.randrange(1, 20)) for _ in range(n)]


def _corpus(train: list[dict]) -> list[str]:
    chat = [f"<|im_start|>system\n{SYSTEM}<|im_end|>\n", "<|im_start|>user\n", "<|im_start|>assistant\n", INSTRUCTION,
            "Here is a reference solution to this problem:", "Problem:", "Steps accepted so far:",
            "New steps to review:", "KEEP", "REVISE 1", "REVISE 2"]
    text = [r["problem"] + "\n" + r["solution"] for r in train]
    return (chat + text) * 20


def build(root) -> dict:
    """Write the tokenizer, model and data under `root`; returns their paths (str) and the texts used."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

    root = Path(root)
    train, evals = rows(12, 0), rows(4, 1)
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(_corpus(train), trainers.BpeTrainer(
        vocab_size=640, special_tokens=list(SPECIALS), initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    common = {"bos_token": "<|endoftext|>", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, chat_template=CHAT_TEMPLATE, **common)
    plain = PreTrainedTokenizerFast(tokenizer_object=bpe, **common)
    paths = {k: root / k for k in ("tokenizer", "model", "plain")}
    tok.save_pretrained(paths["tokenizer"])
    plain.save_pretrained(paths["plain"])
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=len(tok), hidden_size=96, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=24, max_position_embeddings=1024,
                      tie_word_embeddings=True, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id)
    model = Qwen3ForCausalLM(cfg)
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    model.save_pretrained(paths["model"])
    tok.save_pretrained(paths["model"])
    for name, data in (("train.jsonl", train), ("eval.jsonl", evals)):
        (root / name).write_text("".join(json.dumps(r) + "\n" for r in data))
    return {"root": str(root), **{k: str(p) for k, p in paths.items()}, "train": str(root / "train.jsonl"),
            "eval": str(root / "eval.jsonl"), "rows": train, "params": sum(p.numel() for p in model.parameters())}


_BUILT: dict = {}


def built(tmp_path_factory) -> dict:
    """`build` once per test session (a module's fixture calls this: `real = pytest.fixture(...)`)."""
    if "real" not in _BUILT:
        _BUILT["real"] = build(tmp_path_factory.mktemp("realmodel"))
    return _BUILT["real"]


def data_block(real: dict, **extra) -> str:
    """The spec's data section for the built data (YAML flow mapping), with extra settings."""
    fields = {"train": real["train"], "eval": real["eval"], "prompt_field": "problem", **extra}
    return "data: " + json.dumps(fields) + "\n"


def chat(user: str, system: str | None = SYSTEM) -> str:
    """The ChatML text the template renders, written out by hand (BOS, system turn, user turn, generation prompt)."""
    sys_turn = f"<|im_start|>system\n{system}<|im_end|>\n" if system is not None else ""
    return f"<|endoftext|>{sys_turn}<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"
