"""A reward function for prompts.jsonl: 1.0 when the completion ends in the right sum.

posttrain calls a reward function the way TRL does: ``fn(prompts, completions, **columns)``, one
value per completion. Every dataset column other than ``prompt`` arrives as a keyword argument of
the same name, one entry per completion, so the ``answer`` column of each row reaches ``answer``.
A value of ``None`` means "this reward does not apply to this sample".

The tiny built-in model writes a column scratchpad and then the sum after ``|``
(``47+38=7+8=15,4+3+1=8|85``); only the text after the last ``|`` is graded.
"""


def final_answer(completion: str) -> str | None:
    """The text after the last ``|``, or None when the completion never wrote one."""
    if "|" not in completion:
        return None
    return completion.rsplit("|", 1)[1].strip()


def correct_sum(prompts: list[str], completions: list[str], answer: list[str], **columns) -> list[float]:
    """1.0 for each completion whose final answer is its row's ``answer``, else 0.0."""
    return [1.0 if final_answer(completion) == expected else 0.0
            for completion, expected in zip(completions, answer)]
