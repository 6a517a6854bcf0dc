"""Bad data: every bad row is an error naming file, row and field, or (on_bad_row: skip) skipped and counted."""

import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
from _helpers import HEAD, cli, composer

from components.sources.outcome_reward import OutcomeReward
from composer.checks.validate import validate_file
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


# ----------------------------------------------- rows that are not JSON, a duplicate key, a bad timeout (issues 17, 29)


def _data_spec(tmp_path, train) -> Path:
    spec = tmp_path / "spec.yaml"
    spec.write_text(HEAD.replace("{kind: outcome_reward}", "{kind: outcome_reward, verifier: exact}")
                    + f"data: {{train: {json.dumps(str(train))}, prompt_field: q, answer_field: a}}\n")
    return spec


@pytest.mark.parametrize("row, why", [
    ('{"q": "x", "a": ' + "9" * 5000 + "}", "integer string conversion"),
    ('{"q": "x", "a": NaN}', "NaN is not a JSON number"),
    ('{"q": "x", "a": Infinity}', "Infinity is not a JSON number"),
    ("[" * 100000 + "]" * 100000, "nested too deeply"),
])
def test_bad_rows_are_named_not_tracebacks(tmp_path, row, why):
    from composer.runtime.binding import DataError, bind_task

    train = tmp_path / "train.jsonl"
    train.write_text('{"q": "1+1", "a": "2"}\n' + row + "\n")
    v = validate_file(_data_spec(tmp_path, train))
    with pytest.raises(DataError, match=f"row 2: not valid JSON .*{why}"):
        bind_task(v.spec)


def test_a_jsonl_row_with_a_duplicate_key_is_refused(tmp_path):
    from composer.runtime.binding import DataError, bind_task
    from composer.checks.validate import validate_file

    train = tmp_path / "train.jsonl"
    train.write_text('{"q": "1+1", "a": "2"}\n{"q": "2+2", "a": "5", "a": "4"}\n')
    spec = tmp_path / "s.yaml"
    spec.write_text(HEAD.replace("{kind: outcome_reward}", "{kind: outcome_reward, verifier: exact}")
                    + f"data: {{train: {json.dumps(str(train))}, prompt_field: q, answer_field: a}}\n")
    with pytest.raises(DataError, match="row 2: .*the key 'a' appears twice"):
        bind_task(validate_file(spec).spec)


def test_code_rows_with_a_bad_timeout_are_refused():
    from composer.data import Example
    from composer.runtime.binding import DataError, validate_answers

    rows = [Example(prompt="p", answer="assert f(1) == 2", row=i + 1, meta={"timeout": t})
            for i, t in enumerate([5, "soon", -1, 1e9])]
    with pytest.raises(DataError, match="row 2: field 'timeout'"):
        validate_answers(rows, "code")
    kept, skipped = validate_answers(rows, "code", on_bad_row="skip")
    assert [e.row for e in kept] == [1] and skipped == 3


# ----------------------------------------------------- data paths that are not regular files never hang (issues 17, 29)


@pytest.mark.parametrize("kind", ["fifo", "dev_zero"])
def test_special_data_files_do_not_hang(tmp_path, kind):
    from composer.runtime.binding import DataError, bind_task

    if kind == "fifo":
        train = tmp_path / "fifo.jsonl"
        os.mkfifo(train)
    else:
        train = Path("/dev/zero")
    from composer.errors import SpecError

    with pytest.raises(SpecError, match="data.train: .*not a regular file"):  # validate refuses it (issue 56)
        validate_file(_data_spec(tmp_path, train))
    good = tmp_path / "good.jsonl"  # and binding on its own, should the path change after validation
    good.write_text('{"q": "1+1", "a": "2"}\n')
    v = validate_file(_data_spec(tmp_path, good)).spec
    with pytest.raises(DataError, match="not a regular file"):
        bind_task(v.model_copy(update={"data": v.data.model_copy(update={"train": str(train)})}))


@pytest.mark.parametrize("path", ["/proc/kmsg", "/proc/self/status", "/sys/kernel/notes", "/dev/zero", "fifo",
                                  "link_to_proc"])
def test_data_paths_are_regular_files_outside_proc_and_sys(tmp_path, path):
    from composer.runtime.paths import data_path_problem
    from composer.runtime.binding import DataError, bind_task
    from composer.checks.validate import validate_file

    if path == "fifo":
        path = tmp_path / "f.jsonl"
        os.mkfifo(path)
    elif path == "link_to_proc":
        path = tmp_path / "l.jsonl"
        path.symlink_to("/proc/self/status")
    assert "not a regular file" in data_path_problem(path)
    from composer.errors import SpecError

    spec = tmp_path / "s.yaml"
    spec.write_text(HEAD.replace("{kind: outcome_reward}", "{kind: outcome_reward, verifier: exact}")
                    + f"data: {{train: {json.dumps(str(path))}, prompt_field: q, answer_field: a}}\n")
    with pytest.raises(SpecError, match="data.train: .*not a regular file"):  # validate refuses it (issue 56)
        validate_file(spec)
    good = tmp_path / "good.jsonl"  # and binding on its own, should the path change after validation
    good.write_text('{"q": "1+1", "a": "2"}\n')
    v = validate_file(spec, [f"data.train={good}"]).spec
    with pytest.raises(DataError, match="not a regular file"):
        bind_task(v.model_copy(update={"data": v.data.model_copy(update={"train": str(path)})}))
    r = composer("run", spec, "--out", tmp_path / "o", "--no-progress", timeout=120)
    assert r.returncode == 2 and "not a regular file" in r.stderr and not (tmp_path / "o").exists()


# ---------------------------------------------------------------- each data error has the hint of its reason (issue 43)


@pytest.mark.parametrize("row, expected", [
    ('{"question": "1+1?", "answer": "2"}', "set data.prompt_field to the name the rows use"),
    ('{"prompt": "1+1?", "answer": "2"', "each line of a .jsonl file is one JSON object"),
    ('{"prompt": "", "answer": "2"}', "remove the rows with an empty 'prompt'"),
    ('[1, 2]', "each row is an object with named fields"),
    ('{"prompt": ["a"], "answer": "2"}', "must hold text"),
])
def test_each_data_error_has_the_hint_of_its_reason(tmp_path, row, expected):
    """Before: every data error of `explain` said "check data.prompt_field / answer_field / split"."""
    (tmp_path / "d.jsonl").write_text(row + "\n")
    spec = tmp_path / "s.yaml"
    spec.write_text(f"name: d\ndata: {{train: {tmp_path / 'd.jsonl'}}}\nsources: {{verifier: {{kind: outcome_reward, "
                    "verifier: math}}\nsignal: {kind: reward, source: verifier}\nobjective: {kind: grpo}\n")
    r = cli("explain", spec)
    assert r.exit_code == 2 and expected in r.stderr, r.stderr
    assert "check data.prompt_field / answer_field / split" not in r.stderr


def test_a_run_time_data_error_carries_its_hint():
    from composer.cli.run import _failure
    from composer.errors import DataError
    from composer.runtime.binding import MISSING_FIELD, UNPARSABLE_ANSWER

    msg = _failure(DataError("d.jsonl: row 1: field 'answer': missing", field="answer", reason=MISSING_FIELD))
    assert "hint: the rows have no field 'answer': set data.answer_field" in msg
    msg = _failure(DataError("d.jsonl: row 1: field 'answer': verifier 'math': no number", field="answer",
                             reason=UNPARSABLE_ANSWER))
    assert "composer list verifiers" in msg
