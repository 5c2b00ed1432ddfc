"""User reward functions (task.reward: "package.module:function") and one shipped example.

A reward function is `(prompt, completion, reference) -> float | dict[str, float]`: the prompt
text the task made, the decoded completion, the task's reference answer. A dict names its parts;
they are summed into the reward and each is logged as reward/<name>. The function runs in the
driver's scoring threads (shared/scoring.py): it must be thread-safe, and a call that raises or
runs past task.reward_timeout_s scores its sample 0 and is counted.
"""

from __future__ import annotations

import importlib
import inspect
import re
from collections.abc import Callable

RewardFunction = Callable[[str, str, str], "float | dict[str, float]"]


def load_reward_function(spec: str) -> RewardFunction:
    """The callable `spec` names; ValueError (one line) where it cannot be a reward function."""
    module_name, _, attribute = spec.partition(":")
    if not module_name or not attribute:
        raise ValueError(f"{spec!r} is not of the form package.module:function")
    try:
        module = importlib.import_module(module_name)
    except Exception as error:  # ImportError, or the module failing as it loads
        raise ValueError(f"cannot import {module_name} ({type(error).__name__}: {error})") from None
    function = getattr(module, attribute, None)
    if not callable(function):
        raise ValueError(f"{module_name} has no function {attribute!r}")
    try:
        inspect.signature(function).bind("prompt", "completion", "reference")
    except TypeError:
        raise ValueError(f"{spec} must take (prompt, completion, reference), not "
                         f"{inspect.signature(function)}") from None
    except ValueError:  # a builtin without a signature: tried on the first sample instead
        pass
    return function


_FINAL_ANSWER = re.compile(r"\\boxed\{|####")


def format_and_correct(prompt: str, completion: str, reference: str) -> dict[str, float]:
    """Example: 0.1 for stating a final answer the graders look for first (\\boxed{} or ####),
    plus 1.0 when that answer is right (the math grader). Use as
    task.reward: shared.rewards:format_and_correct."""
    from shared.tasks.math_grader import math_grade

    return {"format": 0.1 if _FINAL_ANSWER.search(completion) else 0.0,
            "correct": math_grade(reference, completion)}
