"""``posttrain eval``: greedy held-out accuracy of a model on a built-in task."""

from __future__ import annotations

from posttrain.config import Config, DataConfig, ModelConfig, RolloutConfig


def evaluate_model(model: str | None, *, task: str = "addition", eval_size: int = 500, device: str = "auto") -> str:
    from posttrain.session import OnlineSession, evaluate

    config = Config(
        algorithm="grpo",
        overrides={"beta": 0.0},
        model=ModelConfig(model=model, device=device),
        data=DataConfig(task=task, eval_size=eval_size),
        rollout=RolloutConfig(prompts_per_step=1),
    )
    session = OnlineSession.create(config)
    metrics = evaluate(session)
    name = model or session.fingerprint["model"]
    return f"{name} on {task} ({len(session.work.test_rows)} held-out prompts): " + ", ".join(
        f"{k.removeprefix('eval/')} {v:.4f}" for k, v in sorted(metrics.items())
    )
