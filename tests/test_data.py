"""Bad data: every bad row is an error naming file, row and field, or (on_bad_row: skip) skipped and counted."""

import json
from types import SimpleNamespace

import pytest

from components.sources.outcome_reward import OutcomeReward
from composer.data import Example
from composer.runtime import binding
from composer.runtime.binding import (
    DataError,
    bind_task,
    check_lengths,
    check_task_lengths,
    context_length,
    load_examples,
    validate_answers,
)
from composer.lang.spec import Data


def jsonl(tmp_path, rows, name="train.jsonl"):
    """Write rows (dicts, or raw bytes / str lines written as they are) one a line."""
    p = tmp_path / name
    with p.open("wb") as f:
        for r in rows:
            if isinstance(r, bytes):
                f.write(r + b"\n")
            elif isinstance(r, str):
                f.write(r.encode() + b"\n")
            else:
                f.write(json.dumps(r).encode() + b"\n")
    return p


GOOD = {"problem": "What is 1+1?", "answer": "2"}


def data(path, **kw):
    return Data(train=str(path), prompt_field="problem", answer_field="answer", **kw)


def spec_for(d, verifier="math"):
    return SimpleNamespace(data=d, sources={"verifier": OutcomeReward(verifier=verifier)}, phases=[], stages=[],
                           train=SimpleNamespace(eval_samples=8, seed=0))


def test_good_rows_load(tmp_path):
    p = jsonl(tmp_path, [GOOD, {"problem": "3*3?", "answer": 9, "solution": "3*3=9"}])
    exs, skipped = load_examples(str(p), data(p))
    assert skipped == 0 and [e.answer for e in exs] == ["2", "9"] and exs[1].solution == "3*3=9"
    assert exs[1].row == 2 and exs[1].meta["file"] == str(p)


def test_missing_field_names_file_row_field(tmp_path):
    p = jsonl(tmp_path, [GOOD, {"problem": "no answer here"}, GOOD])
    with pytest.raises(DataError) as e:
        load_examples(str(p), data(p))
    msg = str(e.value)
    assert str(p) in msg and "row 2" in msg and "'answer'" in msg and "missing" in msg
    assert (e.value.file, e.value.row, e.value.field) == (str(p), 2, "answer")


def test_null_field_is_missing(tmp_path):
    p = jsonl(tmp_path, [{"problem": None, "answer": "1"}])
    with pytest.raises(DataError, match=r"row 1: field 'problem': missing"):
        load_examples(str(p), data(p))


def test_empty_prompt(tmp_path):
    p = jsonl(tmp_path, [GOOD, GOOD, {"problem": "   \n", "answer": "1"}])
    with pytest.raises(DataError) as e:
        load_examples(str(p), data(p))
    assert str(p) in str(e.value) and "row 3" in str(e.value) and "'problem'" in str(e.value)
    assert "empty prompt" in str(e.value) and e.value.reason == binding.EMPTY_PROMPT


def test_invalid_utf8_bytes(tmp_path):
    p = jsonl(tmp_path, [GOOD, b'{"problem": "caf\xe9 \xff", "answer": "1"}'])
    with pytest.raises(DataError) as e:
        load_examples(str(p), data(p))
    assert str(p) in str(e.value) and "row 2" in str(e.value) and "not UTF-8" in str(e.value)


def test_lone_surrogate_is_not_text(tmp_path):
    p = jsonl(tmp_path, ['{"problem": "bad \\ud800 text", "answer": "1"}'])
    with pytest.raises(DataError, match=r"row 1: field 'problem': not valid Unicode"):
        load_examples(str(p), data(p))


def test_invalid_json_line(tmp_path):
    p = jsonl(tmp_path, [GOOD, GOOD, GOOD, '{"problem": "unterminated", "answer": '])
    with pytest.raises(DataError) as e:
        load_examples(str(p), data(p))
    assert str(p) in str(e.value) and "row 4" in str(e.value) and "not valid JSON" in str(e.value)


def test_non_object_row_and_non_text_prompt(tmp_path):
    p = jsonl(tmp_path, [[1, 2, 3]])
    with pytest.raises(DataError, match="row 1: expected an object"):
        load_examples(str(p), data(p))
    p = jsonl(tmp_path, [{"problem": [{"role": "user", "content": "hi"}], "answer": "1"}], name="chat.jsonl")
    with pytest.raises(DataError, match=r"row 1: field 'problem': expected text, got list"):
        load_examples(str(p), data(p))


def test_parquet_file_read(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    p = tmp_path / "train.parquet"
    pq.write_table(pa.table({"problem": ["1+1?", "2+2?", "3+3?"], "answer": ["2", "4", None]}), p)
    with pytest.raises(DataError) as e:
        load_examples(str(p), data(p))
    assert str(p) in str(e.value) and "row 3" in str(e.value) and "'answer'" in str(e.value)
    exs, skipped = load_examples(str(p), data(p, on_bad_row="skip"))
    assert [e.prompt for e in exs] == ["1+1?", "2+2?"] and skipped == 1


def test_corrupt_parquet(tmp_path):
    p = tmp_path / "bad.parquet"
    p.write_bytes(b"not a parquet file at all")
    with pytest.raises(DataError, match="not a readable parquet file"):
        load_examples(str(p), data(p))


def test_datasets_directory(tmp_path):
    datasets = pytest.importorskip("datasets")
    out = tmp_path / "ds"
    datasets.Dataset.from_list([GOOD, {"problem": "", "answer": "3"}]).save_to_disk(str(out))
    with pytest.raises(DataError, match=r"row 2: field 'problem': empty prompt"):
        load_examples(str(out), data(out))
    assert load_examples(str(out), data(out, on_bad_row="skip"))[1] == 1


def test_skip_counts_every_kind(tmp_path):
    p = jsonl(tmp_path, [
        GOOD,
        {"problem": "no answer"},                    # missing_field
        {"problem": "", "answer": "1"},              # empty_prompt
        b'{"problem": "\xff", "answer": "1"}',       # not_utf8
        "{not json",                                 # bad_json
        GOOD,
        {"problem": "5*5?", "answer": "\\frac{1}{"},  # unparsable_answer (math)
    ])
    task = bind_task(spec_for(data(p, on_bad_row="skip")))
    assert len(task.train) == 2
    assert task.skipped_rows == 5
    assert task.skipped_by_reason == {"missing_field": 1, "empty_prompt": 1, "not_utf8": 1, "bad_json": 1,
                                      "unparsable_answer": 1}


def test_all_rows_bad_is_an_error_even_when_skipping(tmp_path):
    p = jsonl(tmp_path, [{"problem": "no answer"}, {"q": 1}])
    with pytest.raises(DataError, match=r"no usable rows \(2 skipped"):
        load_examples(str(p), data(p, on_bad_row="skip"))


def test_unparsable_math_answer(tmp_path):
    p = jsonl(tmp_path, [GOOD, {"problem": "Simplify.", "answer": "\\frac{1}{"}])
    with pytest.raises(DataError) as e:
        bind_task(spec_for(data(p)))
    msg = str(e.value)
    assert str(p) in msg and "row 2" in msg and "'answer'" in msg and "math_verify cannot parse" in msg
    exs = [Example(prompt="q", answer=a, row=i + 1, meta={"file": "f.jsonl"})
           for i, a in enumerate(["1/2", "}{", "x^2"])]
    kept, n = validate_answers(exs, "math", "skip")
    assert [e.answer for e in kept] == ["1/2", "x^2"] and n == 1


def test_code_answers_need_tests_that_compile():
    exs = [Example(prompt="q", answer="assert f(1) == 2", row=1), Example(prompt="q", answer="", row=2),
           Example(prompt="q", answer="x", row=3, meta={"tests": "assert (", "file": "c.jsonl"})]
    with pytest.raises(DataError, match=r"c.jsonl: row 3: field 'tests'.*not valid Python"):
        validate_answers(exs[2:], "code", "error")
    kept, n = validate_answers(exs, "code", "skip")
    assert [e.row for e in kept] == [1] and n == 2


def test_auto_verifier_and_other_sources(tmp_path):
    p = jsonl(tmp_path, [GOOD, {"problem": "?", "answer": "}{"}])
    spec = spec_for(data(p, on_bad_row="skip"), verifier="auto")  # auto -> the task's verifier (math)
    assert bind_task(spec).skipped_by_reason == {"unparsable_answer": 1}
    spec.sources = {}  # nothing verifies answers: nothing to check
    assert bind_task(spec).skipped_rows == 0


class WordTokenizer:
    """One token per whitespace-separated word."""

    def encode(self, text, add_special_tokens=False):
        return text.split()


def test_prompt_longer_than_context(tmp_path):
    exs = [Example(prompt="a b c", answer="1", row=1, meta={"file": "t.jsonl"}),
           Example(prompt="a " * 50, answer="1", row=2, meta={"file": "t.jsonl"})]
    with pytest.raises(DataError) as e:
        check_lengths(exs, WordTokenizer(), 10, "error")
    assert "t.jsonl: row 2: field 'prompt'" in str(e.value) and "50 tokens" in str(e.value) and "10" in str(e.value)
    kept, n = check_lengths(exs, WordTokenizer(), 10, "skip")
    assert [x.row for x in kept] == [1] and n == 1
    assert check_lengths(exs, WordTokenizer(), None, "error") == (exs, 0)


def test_check_task_lengths_counts_and_context_length(tmp_path):
    p = jsonl(tmp_path, [GOOD, {"problem": "word " * 40, "answer": "3"}])
    task = bind_task(spec_for(data(p, on_bad_row="skip")))
    policy = SimpleNamespace(config=SimpleNamespace(max_position_embeddings=16))
    assert context_length(policy) == 16 and context_length(SimpleNamespace(), 7) == 7
    assert check_task_lengths(task, WordTokenizer(), context_length(policy), "skip", "problem") == 1
    assert task.skipped_rows == 1 and task.skipped_by_reason == {"too_long": 1} and len(task.train) == 1


def test_check_lengths_with_a_real_tokenizer():
    from components.tasks.tokenizer import char_tokenizer

    exs = [Example(prompt="Q:1+2\nA:", answer="3", row=1), Example(prompt="x" * 40, answer="3", row=2)]
    kept, n = check_lengths(exs, char_tokenizer(), 20, "skip")
    assert [x.row for x in kept] == [1] and n == 1
