"""Conversational data (issue 55 item 3; DESIGN.md section 11): `messages` rows are a data format, and SFT trains
their assistant turns only (composer/conversations.py).

The checkpoint is built here (tests/realmodel.py: a byte-level BPE with a ChatML chat template, a random Qwen3 model;
nothing is downloaded), with variants of its chat template written beside it: one with `{% generation %}` blocks
(transformers' return_assistant_tokens_mask), one whose block stops before the end of turn, one with no newline after
an end of turn (OpenRLHF's multiturn SFT then trains the same tokens), one that rewrites earlier turns.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import realmodel
import torch
from _helpers import clean, cli

from composer.origins import CODE

ROOT = Path(__file__).resolve().parent.parent
TURN = "<|im_end|>"
CHATS = [
    [{"role": "system", "content": "You are a careful assistant."},
     {"role": "user", "content": "Tom has 2 apples and buys 3 more. How many apples does he have?"},
     {"role": "assistant", "content": "He has 2 + 3 = 5 apples. The answer is \\boxed{5}."},
     {"role": "user", "content": "And if he buys 4 more?"},
     {"role": "assistant", "content": "Then 5 + 4 = 9. The answer is \\boxed{9}."}],
    [{"role": "user", "content": "Tom has 7 apples and buys 1 more. How many apples does he have?"},
     {"role": "assistant", "content": "Let me add them: add(7, 1)"},
     {"role": "tool", "content": "8"},
     {"role": "assistant", "content": "He has 8 apples. The answer is \\boxed{8}."}],
    [{"role": "user", "content": "Tom has 4 apples and buys 4 more. How many apples does he have?"},
     {"role": "assistant", "content": "4 + 4 = 8. The answer is \\boxed{8}."}],
]
SFT = ROOT / "specs" / "sft.yaml"
GENERATION = (
    "{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['role'] == 'assistant' %}"
    "{% generation %}{{ m['content'] }}<|im_end|>{% endgeneration %}{% else %}{{ m['content'] }}<|im_end|>{% endif %}"
    "{{ '\\n' }}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)  # the same text as realmodel's ChatML (a newline right after a block tag would be trimmed: trim_blocks)
GENERATION_SHORT = GENERATION.replace("{{ m['content'] }}<|im_end|>{% endgeneration %}",
                                      "{{ m['content'] }}{% endgeneration %}<|im_end|>")
NO_NEWLINE = realmodel.CHAT_TEMPLATE.replace("<|im_end|>\n{% endfor %}", "<|im_end|>{% endfor %}")
NO_TOOLS = realmodel.CHAT_TEMPLATE.replace(
    "{% for m in messages %}", "{% for m in messages %}{% if m['role'] == 'tool' %}{{ raise_exception('no tool turns, "
    "please') }}{% endif %}")
REWRITES = realmodel.CHAT_TEMPLATE.replace(
    "{{ m['content'] }}", "{% if m['role'] == 'assistant' and not loop.last %}(earlier){% else %}{{ m['content'] }}"
    "{% endif %}")


def _variant(real: dict, root: Path, name: str, template: str) -> str:
    """The real model's folder with another chat template."""
    out = root / name
    if not out.exists():
        shutil.copytree(real["model"], out)
        (out / "chat_template.jinja").write_text(template)
    return str(out)


@pytest.fixture(scope="module")
def m(tmp_path_factory) -> dict:
    real = realmodel.built(tmp_path_factory)
    root = tmp_path_factory.mktemp("conversations")
    data = root / "chat.jsonl"
    data.write_text("".join(json.dumps({"messages": c}) + "\n" for c in CHATS * 2))
    assert "<|im_end|>\n" in realmodel.CHAT_TEMPLATE and "{% generation %}" not in realmodel.CHAT_TEMPLATE
    return {"real": real, "root": root, "data": str(data), "model": real["model"],
            "generation": _variant(real, root, "generation", GENERATION),
            "generation_short": _variant(real, root, "generation_short", GENERATION_SHORT),
            "no_newline": _variant(real, root, "no_newline", NO_NEWLINE),
            "rewrites": _variant(real, root, "rewrites", REWRITES), "no_tools": _variant(real, root, "no_tools", NO_TOOLS)}


def bound(m: dict, model: str | None = None, data: str | None = None, *extra):
    """(validated spec, bound task, tokenizer) of specs/sft.yaml on the conversations."""
    from composer.checks.validate import validate_file
    from composer.runtime.binding import bind_task
    from composer.runtime.models import load_tokenizer
    from composer.stops import for_spec

    v = validate_file(SFT, [f"data.train={data or m['data']}", f"policy.model={model or m['model']}", *extra])
    tok = load_tokenizer(model or m["model"])
    for_spec(tok, v.spec)
    return v, bind_task(v.spec), tok


def sft_batch(v, task, tok):
    from composer.runtime.context import RunContext

    ctx = RunContext(task=task, tokenizer=tok, policy=None, engine=None, spec=v.spec)
    return v.spec.signal.make_batch(ctx, task.train)


def runs(origins: list[int], code: int) -> list[tuple[int, int]]:
    out, start = [], None
    for t, c in enumerate(list(origins) + [-1]):
        if c == code and start is None:
            start = t
        elif c != code and start is not None:
            out.append((start, t))
            start = None
    return out


# ------------------------------------------------------------------------------------------ the rows


def test_rows_with_messages_are_conversations_and_each_is_checked():
    from types import SimpleNamespace

    from composer.conversations import Problem, check, is_row

    d = SimpleNamespace(prompt_field="prompt")
    assert is_row({"messages": CHATS[0]}, d) and not is_row({"prompt": "x", "messages": []}, d)
    assert is_row({"prompt": "x", "messages": []}, SimpleNamespace(prompt_field="messages"))
    assert check(json.dumps(CHATS[1])) == CHATS[1]  # a csv cell holding the list as JSON
    assert check([{"role": "user", "content": "a", "name": None}, {"role": "assistant", "content": "b"}])[0] == \
        {"role": "user", "content": "a"}  # a null key is dropped, as transformers does
    cases = {
        "has the role 'bot', not one of system, user, assistant, tool": [{"role": "user", "content": "a"},
                                                                         {"role": "bot", "content": "b"}],
        "message 1 (user) has no content": [{"role": "user"}, {"role": "assistant", "content": "b"}],
        "no assistant turn (roles: system, user)": [{"role": "system", "content": "s"}, {"role": "user", "content": "a"}],
        "(the ShareGPT format)": [{"from": "human", "value": "a"}, {"from": "gpt", "value": "b"}],
        "an empty conversation": [],
        "expected a list of messages": 42,
        "(content parts), not text": [{"role": "user", "content": [{"type": "text", "text": "a"}]},
                                      {"role": "assistant", "content": "b"}],
        "message 2 (assistant) is empty": [{"role": "user", "content": "a"}, {"role": "assistant", "content": " "}],
        "opens with the assistant": [{"role": "assistant", "content": "b"}, {"role": "user", "content": "a"}],
        "message 2 is int, not an object": [{"role": "user", "content": "a"}, 7],
    }
    for want, value in cases.items():
        with pytest.raises(Problem) as e:
            check(value)
        assert want in e.value.what, (want, e.value.what)
        assert e.value.hint
    with pytest.raises(Problem) as e:
        check([{"role": "user", "content": "a"}, {"role": "gpt", "content": "b"}])
    assert "rename it 'assistant'" in e.value.hint


# ------------------------------------------------------------------------------------------ the loss mask


def _check_mask(v, task, tok) -> None:
    """Every row's demonstration tokens are exactly its assistant turns, each with its end of turn; every other token
    is a prompt token; the row is the conversation as the template renders it (less what follows the last turn)."""
    batch = sft_batch(v, task, tok)
    for i, ex in enumerate(task.train):
        origin = batch.origin[i].tolist()
        ids = batch.tokens[i].tolist()
        n = sum(c != CODE["pad"] for c in origin)
        assert set(origin[:n]) == {CODE["prompt"], CODE["demonstration"]}
        turns = [tok.decode(ids[s:e]) for s, e in runs(origin, CODE["demonstration"])]
        assert turns == [msg["content"] + TURN for msg in ex.conversation.messages if msg["role"] == "assistant"]
        whole = tok.apply_chat_template(ex.conversation.messages, tokenize=False)
        assert tok.decode(ids[:n]) + "\n" == whole  # ChatML: the newline after the last end of turn is left out
        assert ids[:n] == tok.encode(whole, add_special_tokens=False)[:n]  # the ids the text tokenizes to


def test_the_loss_mask_is_exactly_the_assistant_turns(m):
    v, task, tok = bound(m)
    assert [ex.conversation.how for ex in task.train] == ["prefixes"] * len(task.train)
    _check_mask(v, task, tok)
    ex = task.train[0]
    assert ex.prompt == tok.apply_chat_template(CHATS[0][:4], tokenize=False, add_generation_prompt=True)
    assert ex.answer == CHATS[0][4]["content"]  # evaluation: the conversation before its last answer, and that answer


def test_generation_blocks_give_the_same_tokens_as_rendering_prefixes(m):
    v, task, tok = bound(m, m["generation"])
    assert [ex.conversation.how for ex in task.train] == ["generation"] * len(task.train)
    _check_mask(v, task, tok)
    _, plain, _ = bound(m)
    assert [(e.conversation.ids, e.conversation.spans) for e in task.train] == \
        [(e.conversation.ids, e.conversation.spans) for e in plain.train]
    v, short, tok = bound(m, m["generation_short"])  # a block that stops before the end of turn: it is taken too
    _check_mask(v, short, tok)
    assert [e.conversation.spans for e in short.train] == [e.conversation.spans for e in plain.train]


def test_a_slow_tokenizer_without_offsets_gives_the_same_tokens(m):
    from composer.conversations import assistant_tokens
    from composer.runtime.models import load_tokenizer

    tok = load_tokenizer(m["model"])

    class NoOffsets:  # a tokenizer without offsets (a slow one): the text is encoded piece by piece
        def __getattr__(self, name):
            return getattr(tok, name)

        def __call__(self, text, **kw):
            if kw.get("return_offsets_mapping"):
                raise NotImplementedError("return_offset_mapping is not available when using Python tokenizers")
            return tok(text, **kw)

    stops = (tok.convert_tokens_to_ids(TURN),)
    for chat in CHATS:
        assert assistant_tokens(NoOffsets(), chat, {}, stops) == assistant_tokens(tok, chat, {}, stops)


def test_a_template_that_rewrites_earlier_turns_is_refused_naming_the_row(m, tmp_path):
    from composer.errors import DataError

    with pytest.raises(DataError) as e:
        bound(m, m["rewrites"])
    text = str(e.value)
    assert f"{m['data']}: row 1: field 'messages'" in text and "cannot be located by rendering prefixes" in text
    assert "{% generation %}" in text
    # skipped and counted with on_bad_row skip: the rows with one assistant turn train
    _v, task, _tok = bound(m, m["rewrites"], None, "data.on_bad_row=skip")
    assert len(task.train) == 2 and task.skipped_by_reason == {"bad_conversation": 4}
    # a template that raises on a row (here: on a tool turn) names the row and the template's message, no traceback
    r = cli("run", SFT, f"data.train={m['data']}", f"policy.model={m['no_tools']}", "train.steps=1",
            "rollout.max_new_tokens=64", "--no-progress", "--out", tmp_path / "no_tools")
    clean(r, (2,))
    assert f"{m['data']}: row 2: field 'messages': the chat template of {m['no_tools']} does not render this " \
        "conversation (TemplateError: no tool turns, please)" in r.output, r.output


# ------------------------------------------------------------------------------------------ a run


def test_sft_on_messages_trains_two_steps_and_explain_says_the_format(m, tmp_path):
    from safetensors.torch import load_file

    out = tmp_path / "run"
    r = cli("run", SFT, f"data.train={m['data']}", f"policy.model={m['model']}", "train.steps=2",
            "train.prompts_per_step=3", "rollout.max_new_tokens=64", "train.samples_every=1", "--no-progress",
            "--out", out)
    clean(r, (0,))
    before, after = load_file(Path(m["model"]) / "model.safetensors"), load_file(out / "model" / "model.safetensors")
    moved = [k for k in before if not torch.equal(before[k], after[k])]
    assert moved, "two SFT steps on the conversations left every weight as it was"
    rows = [json.loads(x) for x in (out / "samples.jsonl").read_text().splitlines()]
    first = next(r for r in rows if r["answer"] == CHATS[0][4]["content"])
    demos = [s["text"] for s in first["spans"] if s["origin"] == "demonstration"]
    assert demos == [CHATS[0][2]["content"], CHATS[0][4]["content"]]  # decoded without special tokens
    assert [s["origin"] for s in first["spans"]] == ["demonstration", "prompt", "demonstration"]

    r = cli("explain", SFT, f"data.train={m['data']}", f"policy.model={m['model']}")
    clean(r, (0,))
    assert ("train data format: messages: 6 conversations (10 assistant turns), assistant turns trained"
            in r.output), r.output
    assert f"| \u27e6{CHATS[0][2]['content']}{TURN}\u27e7" in r.output
    assert "assistant turns found by rendering each turn's prefix" in r.output


def test_the_referee_passes_sft_on_messages(m, tmp_path):
    from composer.referee import referee

    rep = referee(SFT, tmp_path, [f"data.train={m['data']}", f"policy.model={m['model']}", "rollout.max_new_tokens=64",
                                  "train.prompts_per_step=3"])
    assert rep.ok, "\n".join(rep.failures()) + "\n" + rep.table()
    assert rep.checks["loss gradient recomputed (reference)"].passed > 0


# ------------------------------------------------------------------------------------------ refused, never a traceback


def _bad(m, name: str, rows: list, at: int = 3) -> str:
    good = [json.dumps({"messages": c}) for c in CHATS]
    lines = (good * 40)[: at - 1] + [json.dumps(r) if not isinstance(r, str) else r for r in rows]
    path = m["root"] / f"{name}.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return str(path)


@pytest.mark.parametrize("at", [3, 80], ids=["validate", "run"])  # row 80 is past what validate reads (64 rows)
def test_broken_conversations_stop_with_file_row_field_and_fix(m, tmp_path, at):
    cases = {
        "role": ({"messages": [{"role": "user", "content": "a"}, {"role": "bot", "content": "b"}]},
                 "message 2 has the role 'bot'", "rename it 'assistant'"),
        "content": ({"messages": [{"role": "user"}, {"role": "assistant", "content": "b"}]},
                    "message 1 (user) has no content", "give every message its text"),
        "assistant": ({"messages": [{"role": "user", "content": "a"}]}, "no assistant turn", "add the assistant's reply"),
        "control": ({"messages": [{"role": "user", "content": "a<|im_end|>"}, {"role": "assistant", "content": "b"}]},
                    "message 1 (user) holds '<|im_end|>'", "rewrite the text"),
        "mixed": ({"prompt": "a", "answer": "1"}, "field 'messages'", "separate files"),
        "json": ("{not json", "not valid JSON", "one JSON object"),
    }
    for name, (row, what, fix) in cases.items():
        path = _bad(m, f"{name}{at}", [row], at)
        r = cli("run", SFT, f"data.train={path}", f"policy.model={m['model']}", "train.steps=1",
                "rollout.max_new_tokens=64", "--no-progress", "--out", tmp_path / name)
        clean(r, (2,))
        assert f"{path}: row {at}" in r.output and what in r.output and fix in r.output, (name, r.output)
        assert not (tmp_path / name).exists() or not any((tmp_path / name).iterdir())


def test_bad_rows_are_skipped_and_counted_with_on_bad_row_skip(m, tmp_path):
    path = _bad(m, "skip", [{"messages": [{"role": "user", "content": "a"}, {"role": "bot", "content": "b"}]}], 80)
    _v, task, _tok = bound(m, None, path, "data.on_bad_row=skip")
    assert len(task.train) == 79 and task.skipped_by_reason == {"bad_conversation": 1}


def test_no_chat_template_other_methods_and_prompt_settings_are_refused(m, tmp_path):
    from composer.errors import DataError
    from composer.prompts import PromptFormat
    from composer.runtime.conversations import bind

    base = [f"data.train={m['data']}", f"policy.model={m['model']}", "rollout.max_new_tokens=64"]
    r = cli("validate", SFT, *base, f"policy.tokenizer={m['real']['plain']}")
    clean(r, (2,))
    assert "<override 'policy.tokenizer=" in r.output and ":1:1: error: policy.tokenizer:" in r.output
    assert "has none" in r.output and "chat_template" in r.output
    r = cli("validate", ROOT / "specs" / "grpo.yaml", *base)
    clean(r, (2,))
    assert "specs/grpo.yaml:" in r.output and "messages rows (conversations) are SFT data" in r.output
    r = cli("validate", ROOT / "specs" / "hybrids" / "pope-sft.yaml", *base)  # an SFT stage, then POPE: refused
    clean(r, (2,))
    assert "messages rows (conversations) are SFT data" in r.output
    for setting in ("data.system_prompt=Be brief.", "data.prompt_format=plain"):
        r = cli("validate", SFT, *base, setting)
        clean(r, (2,))
        assert "holds messages rows" in r.output and f"drop {setting.split('=')[0]}" in r.output
    # the run's own check, where validation cannot read the tokenizer folder: no template, exit 2 naming file and row
    v, task, _tok = bound(m)
    for ex in task.train:
        ex.conversation.ids = None
    d = v.spec.data
    with pytest.raises(DataError) as e:
        bind(task, v.spec, PromptFormat("plain", tokenizer_name="/models/base"))
    assert f"{d.train}: row 1: field 'messages': the tokenizer /models/base has no chat template" in str(e.value)


# ------------------------------------------------------------------------------------------ OpenRLHF


def _openrlhf_trained(tok, rows: list[dict]) -> list[list[int]]:
    """The token ids OpenRLHF 0.11.2's own SFTDataset (multiturn) trains in each row (its loss mask, shifted as its
    trainer shifts it)."""
    from types import SimpleNamespace

    import datasets
    from openrlhf.datasets.sft_dataset import SFTDataset

    args = SimpleNamespace(data=SimpleNamespace(input_key="messages", output_key=None, apply_chat_template=True,
                                                tokenizer_chat_template=None))
    ds = SFTDataset(datasets.Dataset.from_list(rows), tok, 4096, SimpleNamespace(args=args), multiturn=True,
                    num_processors=1)
    out = []
    for i in range(len(ds)):
        ids, _att, mask = ds[i]
        ids, mask = ids[0].tolist(), mask[0].tolist()
        out.append([ids[j + 1] for j in range(len(ids) - 1) if mask[j]])
    return out


def test_openrlhf_copy_of_the_multiturn_mask_matches_openrlhf(m):
    from composer.conversations import openrlhf_trained
    from composer.runtime.models import load_tokenizer

    for model in (m["model"], m["no_newline"]):
        tok = load_tokenizer(model)
        theirs = _openrlhf_trained(tok, [{"messages": c} for c in CHATS])
        for chat, want in zip(CHATS, theirs):
            ids, trained = openrlhf_trained(tok, chat)
            assert [ids[t] for t in sorted(trained)] == want


def test_openrlhf_maps_messages_sft_natively_only_where_it_trains_the_same_tokens(m, tmp_path):
    base = [f"data.train={m['data']}", "rollout.max_new_tokens=64", "train.steps=2", "train.prompts_per_step=2"]
    r = cli("compile", SFT, *base, f"policy.model={m['model']}", "--backend", "openrlhf", "--gpus-per-node", 1,
            "--out", tmp_path / "chatml")
    clean(r, (2,))
    assert "OpenRLHF's multiturn SFT (--data.multiturn) would not train exactly their assistant turns" in r.output
    assert f"on row 1 of {m['data']}, it also trains 1 token(s) that are not the assistant's ('\\n')" in r.output
    assert "train this spec on lightning" in r.output

    out = tmp_path / "no_newline"
    r = cli("compile", SFT, *base, f"policy.model={m['no_newline']}", "--backend", "openrlhf", "--gpus-per-node", 1,
            "--out", out)
    clean(r, (0,))
    argv = json.loads((out / "args.json").read_text())["main"]
    assert {"--data.multiturn", "--data.apply_chat_template"} <= set(argv)
    assert argv[argv.index("--data.input_key") + 1] == "messages" and "--data.output_key" not in argv
    rows = [json.loads(x) for x in (out / "data" / "train.jsonl").read_text().splitlines()]
    assert len(rows) == 4 and all(set(r) == {"messages"} for r in rows)
    # OpenRLHF's own dataset on the bundle's data trains what the composer trains: each assistant turn + end of turn
    v, task, tok = bound(m, m["no_newline"])
    by_messages = {json.dumps(ex.conversation.messages): ex for ex in task.train}
    batch_rows = sft_batch(v, task, tok)
    for row, trained in zip(rows, _openrlhf_trained(tok, rows)):
        ex = by_messages[json.dumps(row["messages"])]
        i = task.train.index(ex)
        ours = batch_rows.tokens[i][batch_rows.origin[i] == CODE["demonstration"]].tolist()
        assert trained == ours
        assert tok.decode(trained) == "".join(x["content"] + TURN for x in row["messages"] if x["role"] == "assistant")
