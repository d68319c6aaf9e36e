"""The shipped math-answer reward (aligner/rewards/math_answer.py): extraction and equivalence, case by case."""

import pytest

from aligner.rewards.math_answer import answers_match, extract_answer, flexible_reward_fn, reward_fn, to_number


@pytest.mark.parametrize(
    "text, strict, answer",
    [
        ("so the answer is \\boxed{42}.", True, "42"),
        ("first \\boxed{1}, then \\boxed{2}", True, "2"),
        ("\\boxed{\\frac{\\sqrt{2}}{2}}", True, "\\frac{\\sqrt{2}}{2}"),
        ("\\boxed{12", True, None),  # never closed
        ("Natalia sold 48 + 24 = 72 clips.\n#### 72", True, "72"),
        ("#### 1,000 dollars\nmore text", True, "1,000"),
        ("#### $18", True, "18"),
        ("#### seventy", True, "seventy"),
        ("\\boxed{3} wait, no\n#### 4", True, "4"),  # whichever comes last
        ("#### 4 no: \\boxed{3}", True, "3"),
        ("the answer is 42", True, None),
        ("the answer is 42, not 41.5", False, "41.5"),
        ("no digits here", False, None),
        ("it is 7", False, "7"),
    ],
)
def test_extract_answer(text, strict, answer):
    assert extract_answer(text, strict) == answer


@pytest.mark.parametrize(
    "a, b, same",
    [
        ("42", "42", True),
        ("42.0", "42", True),
        ("0.5", "1/2", True),
        ("\\frac{1}{2}", "0.5", True),
        ("\\dfrac{6}{8}", "3/4", True),
        ("\\frac34", "0.75", True),
        ("1,000", "1000", True),
        ("-3", "-3.00", True),
        ("$18", "18", True),
        ("50\\%", "50", True),
        ("x = 5", "5", True),
        ("5.", "5", True),
        (".5", "1/2", True),
        ("2", "3", False),
        ("1/3", "0.333", False),  # exact: 0.333 is not a third
        ("1/0", "0", False),
        ("\\frac{\\sqrt{2}}{2}", "\\frac{\\sqrt{2}}{2}", True),  # not numbers: compared as text
        ("\\sqrt{2}", "\\sqrt{3}", False),
        ("Seventy", "seventy", True),
        (None, "1", False),
    ],
)
def test_answers_match(a, b, same):
    assert answers_match(a, b) is same


def test_to_number_is_exact():
    from fractions import Fraction

    assert to_number("\\frac{2}{4}") == Fraction(1, 2)
    assert to_number("1,234.5") == Fraction(2469, 2)
    assert to_number("abc") is None


def test_reward_functions():
    responses = ["so \\boxed{4}", "#### 5", "it is 4", "4"]
    assert reward_fn(["p"] * 4, responses, ["4"] * 4) == [1.0, 0.0, 0.0, 0.0]
    assert flexible_reward_fn(["p"] * 4, responses, ["4"] * 4) == [1.0, 0.0, 1.0, 1.0]
    with pytest.raises(ValueError, match="label"):
        reward_fn(["p"], ["4"], [None])
