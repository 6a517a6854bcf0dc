"""The `math` verifier on hostile outputs: only the final \\boxed{} counts when there is one, a `#` answer line
or an anchored answer ("the final answer is") otherwise, and never a number scattered in free text. Each case
says what the docs promise (docs/own-model-and-data.md, "Verifiers and code rewards": "only the last
\\boxed{}") and what the verdict must be."""

from __future__ import annotations

import pytest

from components.tasks.verifiers import math_verifier
from composer.data import Example

ECHO = "Please reason step by step, and put your final answer within \\boxed{}."
CASES = [
    # (response, reference answer, reward, parsed, the answer read)
    ("garbage 3 9 74 xx", "74", 0.0, False, None),  # before: 1.0 (the last number of any text)
    ("74", "74", 0.0, False, None),  # a bare number is no stated answer
    ("1 2 3 4 5 6 7 8 9 10 ... 74 75 76", "74", 0.0, False, None),  # enumerate numbers, hope one hits
    ("\\boxed{3} no wait \\boxed{74}", "74", 1.0, True, "74"),  # several boxes: the last one
    ("\\boxed{74} no wait \\boxed{3}", "74", 0.0, True, "3"),
    (f"{ECHO}\nHe has 12 + 62 = 74 apples.", "74", 0.0, False, None),  # the prompt's empty box echoed last
    (f"{ECHO}\nSo \\boxed{{74}}.", "74", 1.0, True, "74"),  # an echo before the answer's own box
    ("\\boxed{74", "74", 0.0, False, None),  # unbalanced
    ("\\boxed{7} and then 74", "74", 0.0, True, "7"),  # text after the box does not count
    ("\\boxed{\\frac{1}{2}}", "0.5", 1.0, True, "\\frac{1}{2}"),
    ("The final answer is 74.", "74", 1.0, True, "74"),  # an anchored answer without a box
    ("work\n#74", "74", 1.0, True, "74"),  # the toy's answer line
    ("## Step 74\nblah", "74", 0.0, False, None),  # a markdown heading is no answer line
    # GSM8K's own format (its `answer` column; what a model SFT'd on GSM8K writes): before, parsed as nothing
    ("Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n#### 72", "72", 1.0, True, "72"),
    ("#### 46", "46", 1.0, True, "46"),
    ("#### 45", "46", 0.0, True, "45"),
    ("#### 1,000", "1000", 1.0, True, "1000"),  # thousands separators
    ("#### $18", "18", 1.0, True, "18"),
    ("#### -3.5", "-7/2", 1.0, True, "-3.5"),
    ("#### 3\nno wait\n#### 46", "46", 1.0, True, "46"),  # the last `####` line
    ("#### Step 74\nblah", "74", 0.0, False, None),  # a markdown heading `#### Step` is no GSM8K answer
    # MATH-style and free-text final-answer forms
    ("So the answer is 46.", "46", 1.0, True, "46"),
    ("The answer is: $\\frac{3}{4}$", "0.75", 1.0, True, "3/4"),
    ("Final Answer: The final answer is $\\boxed{46}$. I hope it is correct.", "46", 1.0, True, "46"),
]

GSM8K_REFERENCE = ("Weng earns 12/60 = $<<12/60=0.2>>0.2 per minute.\nWorking 50 minutes, she earned 0.2 x 50 = "
                   "$<<0.2*50=10>>10.\n#### 10")


@pytest.mark.parametrize("response, reward", [("#### 10", 1.0), ("The answer is 10.", 1.0), ("\\boxed{10}", 1.0),
                                              ("#### 50", 0.0), ("#### 0.2", 0.0)])
def test_a_gsm8k_answer_column_as_the_reference_is_read_by_its_number(response, reward):
    """A row whose `answer` is GSM8K's worked solution (as the dataset ships it) is compared by its `####`
    number, not by a number met on the way (0.2, 50); the row check accepts it."""
    from components.tasks.verifiers import math_answer_problem

    ex = Example(prompt="p", answer=GSM8K_REFERENCE)
    assert math_answer_problem(ex) is None
    assert math_verifier(response, ex).reward == reward


@pytest.mark.parametrize("response, answer, reward, parsed, read", CASES)
def test_hostile_outputs_score_as_the_readme_says(response, answer, reward, parsed, read):
    v = math_verifier(response, Example(prompt="p", answer=answer))
    assert (v.reward, v.parsed, v.answer) == (reward, parsed, read), v
    if not parsed:
        assert "could not parse a final answer" in v.detail
    elif reward == 0.0:
        assert f"read {read!r}" in v.detail


def test_composer_samples_prints_what_the_verifier_read():
    from composer.runtime.samples import guide_lines

    row = {"verifier": {"parsed": True, "detail": "the final answer is wrong (read '3' from the last \\boxed{})",
                        "answer": "3"}}
    assert "verifier read: 3" in guide_lines(row)


@pytest.mark.parametrize("response, answer, reward, read", [
    ("#### 18.", "18", 1.0, "18"),  # before: unparsed (a sentence's period after the number)
    ("So she has 18 left.\n#### 18.", "18", 1.0, "18"),
    ("#### 1,000.", "1000", 1.0, "1000"),
    ("#### 18, done", "18", 1.0, "18"),
    ("#### 17.", "18", 0.0, "17"),
    ("#### 18.5", "18.5", 1.0, "18.5"),  # a decimal is still one number
    ("#### 3/4.", "0.75", 1.0, "3/4"),
])
def test_a_gsm8k_answer_line_may_end_with_a_period(response, answer, reward, read):
    """Issue 56: `#### 18.` was read as no answer at all (parsed False), so a correct response scored 0."""
    v = math_verifier(response, Example(prompt="p", answer=answer))
    assert (v.reward, v.parsed, v.answer) == (reward, True, read), v


def test_a_dotted_run_of_numbers_is_no_gsm8k_answer():
    from components.tasks.verifiers import gsm8k_answer

    assert gsm8k_answer("#### 1.2.3") is None and gsm8k_answer("#### 18.") == "18"
