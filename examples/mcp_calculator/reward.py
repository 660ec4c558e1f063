def final_sum(prompts, completions, answer, **columns):
    """1.0 where the answer written after the last tool result (the text after its ``;``) is the sum."""
    return [float(c.rsplit(";", 1)[-1].strip() == a) for c, a in zip(completions, answer)]
