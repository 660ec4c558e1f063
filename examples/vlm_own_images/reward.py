"""The reward: 1.0 when the model's answer is the row's count, else 0.0.

With chat prompts a completion is the list of messages the model added (TRL's convention); its text is the last
message's content."""


def exact(prompts, completions, answer, **columns):
    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
    return [float(text.strip() == expected) for text, expected in zip(texts, answer)]
