"""A verifiable reward for math answers: 1.0 when the response's final answer equals the label, else 0.0.

Use it as a reward function (docs/REWARDS.md): `reward.fn: aligner/rewards/math_answer.py` (strict) or
`aligner/rewards/math_answer.py:flexible_reward_fn`. The label is the reference answer (data.label_key), e.g. the
part after `####` of a GSM8K solution.

- `extract_answer(text, strict=True)`: the final answer of a response: the content of its last `\\boxed{...}`
  (nested braces allowed) or the rest of the line after its last `####`, whichever comes last; None without either.
  With strict=False, a response with neither gives its last number instead.
- `answers_match(answer, reference)`: equal as numbers when both read as numbers (integers, decimals, `a/b`,
  `\\frac{a}{b}`, thousands separators, `$`, `%`, a leading `x =`): 0.5 == 1/2 == \\frac{2}{4}, 1,000 == 1000.0;
  otherwise equal as text after the same clean-up (spaces and case ignored).
Pure Python (re, fractions): it runs in the reward worker processes without torch.
"""

from __future__ import annotations

import re
from fractions import Fraction

_NUMBER = r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:/\d+)?|-?\.\d+"
_FRAC = re.compile(r"\\[dt]?frac\s*\{([^{}]*)\}\s*\{([^{}]*)\}|\\[dt]?frac\s*(\d)\s*(\d)")


def _last_boxed(text: str) -> tuple[int, str] | None:
    """(start, content) of the last complete \\boxed{...}."""
    found = None
    for m in re.finditer(r"\\boxed\s*\{", text):
        depth, i = 1, m.end()
        while i < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        if depth == 0:
            found = (m.start(), text[m.end() : i - 1])
    return found


def _last_hashes(text: str) -> tuple[int, str] | None:
    """(start, answer) after the last `####`: its leading number if it has one, else the rest of the line."""
    matches = list(re.finditer(r"####[ \t]*([^\n]*)", text))
    if not matches:
        return None
    m = matches[-1]
    rest = m.group(1).strip()
    number = re.match(rf"\$?({_NUMBER})", rest)
    return m.start(), number.group(1) if number else rest


def extract_answer(text: str, strict: bool = True) -> str | None:
    candidates = [c for c in (_last_boxed(text), _last_hashes(text)) if c is not None]
    if candidates:
        return max(candidates)[1].strip()
    if strict:
        return None
    numbers = re.findall(_NUMBER, text)
    return numbers[-1] if numbers else None


def _clean(text: str) -> str:
    s = text.strip().rstrip(".").strip()  # a sentence's full stop, not a leading decimal point
    s = re.sub(r"^[a-zA-Z]\s*=\s*", "", s)  # "x = 5"
    s = s.replace("\\$", "").replace("$", "").replace("\\%", "").replace("%", "").replace("\\!", "")
    s = re.sub(r"\\text\{\s*\}", "", s)
    s = _FRAC.sub(lambda m: f"({m.group(1) or m.group(3)})/({m.group(2) or m.group(4)})", s)
    return re.sub(r"\s+", "", s)


def to_number(text: str) -> Fraction | None:
    """The exact value of a cleaned answer that is a number or a simple fraction, else None."""
    s = _clean(text)
    m = re.fullmatch(r"\(?(-?[\d.,]+)\)?/\(?(-?[\d.,]+)\)?", s)
    try:
        if m:
            num, den = (Fraction(g.replace(",", "")) for g in m.groups())
            return num / den if den != 0 else None
        if re.fullmatch(_NUMBER, s):
            return Fraction(s.replace(",", ""))
    except (ValueError, ZeroDivisionError):
        return None
    return None


def answers_match(answer: str | None, reference: str | None) -> bool:
    if answer is None or reference is None:
        return False
    a, b = to_number(answer), to_number(reference)
    if a is not None and b is not None:
        return a == b
    return _clean(answer).lower() == _clean(reference).lower()


def _score(responses, labels, strict: bool) -> list[float]:
    out = []
    for response, label in zip(responses, labels):
        if label is None:
            raise ValueError("math_answer needs each prompt's reference answer as its label (data.label_key)")
        out.append(1.0 if answers_match(extract_answer(response, strict), str(label)) else 0.0)
    return out


def reward_fn(prompts, responses, labels):
    """1.0 if the \\boxed{} / #### answer of the response equals the label, else 0.0."""
    return _score(responses, labels, strict=True)


def flexible_reward_fn(prompts, responses, labels):
    """As reward_fn, but a response without \\boxed{} or #### is judged by its last number."""
    return _score(responses, labels, strict=False)
