"""The toy testbed: problems, verifiers, step checker, tokenizer and checkpoints."""

import json
import random

import pytest

from components.tasks import toy
from components.tasks.verifiers import exact_verifier, math_verifier, toy_verifier
from composer.data import Example, Task


def ex(answer, **kw):
    return Example(prompt="q", answer=answer, **kw)


# ------------------------------------------------------------------------------------- problems


def test_solution_format():
    e = toy.make_example("7+3-5+9")
    assert e.prompt == "Q:7+3-5+9\nA:"
    assert e.problem == "7+3-5+9"
    assert e.solution == "7+3=0\n0-5=5\n5+9=4\n#4"
    assert e.answer == "4" and e.tier == 3


def test_make_examples_deterministic_and_tiered():
    a = toy.make_examples(4, 50, seed=3, split="train")
    b = toy.make_examples(4, 50, seed=3, split="train")
    assert [x.problem for x in a] == [x.problem for x in b]
    assert [x.problem for x in a] != [x.problem for x in toy.make_examples(4, 50, seed=4, split="train")]
    assert all(x.tier == 4 and len(x.solution.split("\n")) == 5 for x in a)
    assert len({x.problem for x in a}) == 50  # distinct


def test_train_eval_disjoint():
    for tier in (1, 2, 4, 8):
        train = {x.problem for x in toy.make_examples(tier, 200, 0, "train")}
        evals = {x.problem for x in toy.make_examples(tier, 64, 0, "eval")}
        assert train.isdisjoint(evals)
    task = toy.toy_task()
    sampled = task.sample_train(random.Random(0), 500)
    all_eval = {x.problem for xs in task.eval.values() for x in xs}
    assert all(x.tier in (2, 4, 6) for x in sampled)
    assert all_eval.isdisjoint({x.problem for x in sampled + task.train})


def test_toy_task_fields():
    task = toy.toy_task()
    assert isinstance(task, Task) and task.name == "toy" and task.verifier == "toy"
    assert set(task.eval) == {"tier1", "tier2", "tier4", "tier6", "tier8"}
    assert all(len(v) == 64 for v in task.eval.values())
    assert task.max_new_tokens >= 6 * 8 + 3 and task.step_split == "\n"
    assert task.student is None and task.teacher is None
    for key in ("reference", "feedback", "sibling", "prefix", "judge"):
        assert "{problem}" in task.templates[key]


def test_write_jsonl(tmp_path):
    paths = toy.write_jsonl(str(tmp_path), {"tiers": (1, 8), "eval_per_tier": 5, "train_per_tier": 3})
    assert set(paths) == {"train", "eval_1", "eval_8"}
    with open(paths["eval_8"]) as f:
        rows = [json.loads(line) for line in f]
    assert len(rows) == 5 and set(rows[0]) == {"prompt", "problem", "answer", "solution", "tier"}
    assert rows[0]["prompt"] == f"Q:{rows[0]['problem']}\nA:" and rows[0]["solution"].endswith("#" + rows[0]["answer"])
    with open(paths["train"]) as f:
        assert len(f.readlines()) == 9


def test_templates_and_judge_helpers():
    e = toy.make_example("7+3-5+9")
    prompt, target = toy.prefix_prompt(e, 1)
    assert prompt == "Q:7+3-5+9\nP:7+3=0\nA:" and target == "0-5=5\n5+9=4\n#4"
    assert toy.judge_prompt(e, ["7+3=0"], ["0-5=5", "5+9=1"]) == "J:7+3-5+9\nC:7+3=0\nN:\n1:0-5=5\n2:5+9=1\nV:"
    assert toy.judge_target(e, ["7+3=0"], ["0-5=5", "5+9=1"]) == "REVISE 2\n5+9=4"
    assert toy.judge_target(e, ["7+3=0"], ["0-5=5"]) == "KEEP"
    assert toy.parse_judge("REVISE 2\n5+9=4") == (2, "5+9=4") and toy.parse_judge("KEEP") is None
    assert toy.TEMPLATES["reference"].format(problem=e.problem, solution=e.solution).endswith("\nQ:7+3-5+9\nA:")


# -------------------------------------------------------------------------------------- variants


def test_default_variant_draws_are_those_of_the_original_testbed(monkeypatch):
    monkeypatch.delenv(toy.VARIANT_ENV, raising=False)
    assert toy.variant() == "mod10" and toy.modulus() == 10
    # the problems the testbed drew before variants existed (seeded streams: any change breaks every cache)
    assert [e.problem for e in toy.make_examples(6, 4, 0, "eval")] == [
        "9+2+3+8+7-5-7", "4-8+5+4-7+6-5", "8+3-6-6+7-9-4", "1-2-0+5-9+5-8"]
    assert [e.problem for e in toy.make_examples(2, 4, 1, "train")] == ["0-9+4", "7-9-6", "7+0+4", "0+4+0"]
    assert [e.problem for e in toy.toy_task().sample_train(random.Random(7), 4)] == [
        "2-0+8+5+8", "0+6-1", "9+9-0", "0+4-2"]
    from components.tasks import bootstrap

    assert bootstrap.cache_key() == "toy-v2" and bootstrap.cache_folder().endswith("/toy-v2")
    assert toy.toy_task().name == "toy"


def test_mod7_variant(monkeypatch, tmp_path):
    from components.tasks import bootstrap

    monkeypatch.setenv(toy.VARIANT_ENV, "mod7")
    monkeypatch.setenv("COMPOSER_CACHE", str(tmp_path))
    assert toy.modulus() == 7
    e = toy.make_example("6+3-5+4")
    assert e.solution == "6+3=2\n2-5=4\n4+4=1\n#1" and e.answer == "1"
    exs = toy.make_examples(6, 50, 0, "eval")
    assert all(set(x.problem) <= set("0123456+-") for x in exs) and len({x.problem for x in exs}) == 50
    train = {x.problem for x in toy.make_examples(6, 200, 0, "train")}
    assert train.isdisjoint(x.problem for x in exs)
    assert all(toy_verifier(x.solution, x).reward == 1.0 and int(x.answer) < 7 for x in exs)
    task = toy.toy_task(eval_per_tier=4, train_per_tier=4)
    assert task.name == "toy-mod7" and all(set(x.problem) <= set("0123456+-") for x in task.sample_train(random.Random(0), 50))
    assert toy.judge_target(e, ["6+3=2"], ["2-5=3"]) == "REVISE 1\n2-5=4"
    assert bootstrap.cache_key() == "toy-v2-mod7" and bootstrap.cache_folder() == str(tmp_path / "toy-v2-mod7")
    rng = random.Random(0)
    assert all(bootstrap.corrupt("6+3=2", rng)[-1] in "013456" for _ in range(50))  # wrong, and a mod-7 digit
    monkeypatch.setenv(toy.VARIANT_ENV, "mod11")
    with pytest.raises(ValueError, match="mod10, mod7"):
        toy.variant()


@pytest.mark.slow
def test_mod7_checkpoints(monkeypatch):
    """The held-out variant's bootstrapped pair (about 20 minutes to build on 2 busy cores, once)."""
    from components.tasks.bootstrap import ensure_checkpoints, evaluate_greedy

    monkeypatch.setenv(toy.VARIANT_ENV, "mod7")
    paths = ensure_checkpoints()
    assert paths["student"].endswith("toy-v2-mod7/student")
    assert evaluate_greedy(paths["student"], 1, 64) >= 0.9
    assert evaluate_greedy(paths["student"], 6, 64) < evaluate_greedy(paths["teacher"], 6, 64)


# ------------------------------------------------------------------------------------ verifiers


def test_toy_verifier():
    e = toy.make_example("7+3-5+9")
    assert toy_verifier(e.solution, e).reward == 1.0
    assert toy_verifier("#4\n\n", e).reward == 1.0
    v = toy_verifier("7+3=0\n#5", e)
    assert v.reward == 0.0 and v.parsed and "wrong" in v.detail
    assert toy_verifier("#4\n7+3=0", e).reward == 0.0  # must end with the answer line
    v = toy_verifier("7+3=0\n0-5=5", e)
    assert v.reward == 0.0 and not v.parsed
    assert not toy_verifier("", e).parsed


def test_exact_verifier():
    assert exact_verifier("so the answer is\n#  Paris. ", ex("paris")).reward == 1.0
    assert exact_verifier("we get \\boxed{\\frac{1}{2}} done", ex("\\frac{1}{2}")).reward == 1.0
    assert exact_verifier("  Hello   World. ", ex("hello world")).reward == 1.0
    assert exact_verifier("#4", ex("5")).reward == 0.0
    assert not exact_verifier("   ", ex("5")).parsed


def test_math_verifier():
    assert math_verifier("thus \\boxed{\\frac{1}{2}}", ex("0.5")).reward == 1.0
    assert math_verifier("the result is $x = 2$, so \\boxed{2}", ex("2")).reward == 1.0
    assert math_verifier("steps\n#4", ex("4")).reward == 1.0
    v = math_verifier("\\boxed{3}", ex("4"))
    assert v.reward == 0.0 and v.parsed
    v = math_verifier("I do not know", ex("4"))
    assert v.reward == 0.0 and not v.parsed


def test_verifiers_registered_lazily():
    from composer.registry import VERIFIERS

    assert {"toy", "exact", "math"} <= set(VERIFIERS)
    assert VERIFIERS["toy"].load() is toy_verifier


# -------------------------------------------------------------------------------- step checker


def test_step_checker():
    e = toy.make_example("7+3-5+9")
    c = toy.ToyStepChecker()
    assert c.first_wrong_step(e, ["7+3=0", "0-5=5", "5+9=4", "#4"]) is None
    assert c.first_wrong_step(e, ["7+3=0", "0-5=5", "5+9=4", "#4", ""]) is None
    assert c.first_wrong_step(e, ["7+3=0", "0-5=6", "6+9=5", "#5"]) == 1
    assert c.first_wrong_step(e, ["7+3=0", "0-5=5", "5+9=4", "#3"]) == 3  # final line checked
    assert c.first_wrong_step(e, ["7+3=0", "0-5=5"]) == 2  # missing steps
    assert c.first_wrong_step(e, ["7+3=0", "0-5=5", "5+9=4", "#4", "junk"]) == 4  # extra junk
    assert c.first_wrong_step(e, []) == 0
    assert c.correct_step(e, ["7+3=0", "0-5=6"], 1) == "0-5=5"
    assert c.correct_step(e, [], 3) == "#4"


def test_feedback_text():
    e = toy.make_example("7+3-5+9")
    c = toy.ToyStepChecker()
    assert c.feedback_text(e, "7+3=0\n0-5=6\n#6", "answer") == "the final answer is wrong"
    assert c.feedback_text(e, "7+3=0\n0-5=6\n#6", "step") == "the final answer is wrong; step 2 is wrong"


# ----------------------------------------------------------------------- tokenizer, checkpoints


def test_tokenizer_round_trip(tmp_path):
    from transformers import AutoTokenizer

    from components.tasks.tokenizer import build_char_tokenizer

    build_char_tokenizer(str(tmp_path))
    tok = AutoTokenizer.from_pretrained(str(tmp_path))
    s = "Q:7+3-5+9\nA:7+3=0\n  Two  spaces, ~{}[]|\\ \n#4\n"
    ids = tok.encode(s)
    assert len(ids) == len(s) and tok.unk_token_id not in ids
    assert tok.decode(ids) == s
    assert tok.decode(ids + [tok.eos_token_id], skip_special_tokens=True) == s
    assert tok.pad_token == "<pad>" and tok.eos_token == "<eos>" and tok.pad_token_id != tok.eos_token_id


def test_tiny_random_checkpoint(tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from components.tasks.bootstrap import other_vocab_checkpoint, tiny_random_checkpoint

    d = tiny_random_checkpoint(str(tmp_path / "tiny"))
    model, tok = AutoModelForCausalLM.from_pretrained(d), AutoTokenizer.from_pretrained(d)
    enc = tok(["Q:1+2\nA:", "Q:1+2-3\nA:"], return_tensors="pt", padding=True)
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=4, do_sample=False, pad_token_id=tok.pad_token_id)
    assert out.shape[0] == 2 and model.config.vocab_size == len(tok)
    o = other_vocab_checkpoint(str(tmp_path / "other"))
    assert AutoTokenizer.from_pretrained(o).get_vocab() != tok.get_vocab()
    assert AutoModelForCausalLM.from_pretrained(o).config.vocab_size != model.config.vocab_size


@pytest.mark.slow
def test_bootstrapped_checkpoints():
    from components.tasks.bootstrap import ensure_checkpoints, evaluate_greedy

    paths = ensure_checkpoints()
    assert evaluate_greedy(paths["student"], 1, 64) >= 0.9
    assert evaluate_greedy(paths["student"], 6, 64) < evaluate_greedy(paths["teacher"], 6, 64)
