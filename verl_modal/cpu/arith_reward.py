"""Dense shaping reward for the tiny arithmetic task, as verl's ``custom_reward_function``.

With exact match alone a random-init model scores 0 on every sample, every GRPO group has
zero advantage and nothing is learned. This reward adds a dense term: the fraction of the
answer's digits the response gets right, position by position, plus 1.0 for the exact answer.

Invariants: ``compute_score`` returns a float in [0, 2]; 2.0 exactly when the answer is right;
0.0 when the response holds no number.
"""

from __future__ import annotations

import re

_NUMBER = re.compile(r"-?\d+")


def extract_answer(response: str) -> str | None:
    """The number after the last ``####`` if present, else the last number in the response."""
    tail = response.rsplit("####", 1)[1] if "####" in response else response
    numbers = _NUMBER.findall(tail)
    if not numbers:
        return None
    return numbers[0] if "####" in response else numbers[-1]


def digit_score(predicted: str, truth: str) -> float:
    """Fraction of positions where the two digit strings agree, over the longer length."""
    if not predicted or not truth:
        return 0.0
    same = sum(a == b for a, b in zip(predicted, truth, strict=False))
    return same / max(len(predicted), len(truth))


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs) -> float:
    """verl's custom reward signature; ``ground_truth`` is the answer as a decimal string."""
    truth = str(ground_truth).strip()
    answer = extract_answer(solution_str)
    if answer is None:
        return 0.0
    return digit_score(answer, truth) + (1.0 if answer == truth else 0.0)
