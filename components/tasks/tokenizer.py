"""A character-level tokenizer for the toy testbed: one token per character, exact round trip."""

from __future__ import annotations

import string

SPECIALS = ("<pad>", "<eos>", "<unk>", "<bos>")
# every printable ASCII character (space included) plus newline; no tab/CR/form feeds
CHARS = tuple(c for c in string.printable if c not in "\t\r\x0b\x0c")


def _make_fast(chars, specials: dict[str, str]):
    """A PreTrainedTokenizerFast over `chars` with special tokens {role: token}."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    names = list(specials.values())
    vocab = {tok: i for i, tok in enumerate(names + [c for c in chars if c not in names])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=specials["unk_token"]))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")  # every char alone
    tok.decoder = decoders.Fuse()  # join tokens with no separator
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, clean_up_tokenization_spaces=False, padding_side="left", **specials
    )
    fast.model_max_length = 512
    return fast


def char_tokenizer():
    """The toy testbed's tokenizer object (printable ASCII + newline, <pad>/<eos>/<unk>/<bos>)."""
    return _make_fast(CHARS, {"pad_token": "<pad>", "eos_token": "<eos>", "unk_token": "<unk>", "bos_token": "<bos>"})


def build_char_tokenizer(out_dir: str):
    """Build the char tokenizer and save it to `out_dir` (loadable with AutoTokenizer); returns it."""
    tok = char_tokenizer()
    tok.save_pretrained(out_dir)
    return tok


def other_vocab_tokenizer():
    """A deliberately different vocabulary (lowercase, digits and a few symbols, other specials)."""
    chars = tuple(string.ascii_lowercase + string.digits + "+-=#:\n ")
    return _make_fast(chars, {"pad_token": "[PAD]", "eos_token": "[END]", "unk_token": "[UNK]"})
