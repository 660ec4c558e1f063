"""The training loop in docs/functional.md runs, and its micro-batches give the whole-step gradient."""

import re
from pathlib import Path
from types import SimpleNamespace

import torch

import posttrain.functional as F

DOC = Path(__file__).resolve().parents[1] / "docs" / "functional.md"
VOCAB, LENGTH, PROMPT, G = 11, 7, 2, 3


class TinyLM(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, 8)
        self.head = torch.nn.Linear(8, VOCAB)

    def forward(self, tokens: torch.Tensor) -> SimpleNamespace:
        return SimpleNamespace(logits=self.head(torch.tanh(self.embed(tokens).cumsum(dim=1))))


class RecordingOptimizer:
    def __init__(self, model: torch.nn.Module) -> None:
        self.model, self.grads = model, []

    def step(self) -> None:
        self.grads.append([p.grad.clone() for p in self.model.parameters()])

    def zero_grad(self) -> None:
        self.model.zero_grad()


def _setup():
    torch.manual_seed(0)
    policy, ref_model = TinyLM(), TinyLM()
    tokens = torch.randint(0, VOCAB, (2 * G, LENGTH))
    lengths = torch.tensor([5, 1, 3, 0, 4, 2])  # completion tokens per row, one empty
    positions = torch.arange(LENGTH - 1)  # position p predicts tokens[:, p + 1]
    mask = ((positions >= PROMPT - 1) & (positions < PROMPT - 1 + lengths[:, None])).long()
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.0, 1.0, 1.0])
    return policy, ref_model, tokens, mask, rewards


def test_docs_loop_runs_and_equals_one_whole_batch_call():
    code = re.search(r"```python\n(.*?)```", DOC.read_text(), re.DOTALL).group(1)
    policy, ref_model, tokens, mask, rewards = _setup()
    optimizer = RecordingOptimizer(policy)
    namespace = dict(
        loader=[["prompt a", "prompt b"]], generate=lambda model, prompts, group_size: (tokens, mask),
        reward_fn=lambda prompts, t: rewards, policy=policy, ref_model=ref_model, G=G,
        micro_batch_size=4, optimizer=optimizer, print=lambda *args: None,
    )
    exec(compile(code, str(DOC), "exec"), namespace)
    assert len(optimizer.grads) == 1

    # the same step as one call on the whole batch
    logp = F.selective_log_softmax(policy(tokens).logits[:, :-1], tokens[:, 1:])
    with torch.no_grad():
        ref_logp = F.selective_log_softmax(ref_model(tokens).logits[:, :-1], tokens[:, 1:])
    adv = F.advantages("group", rewards.view(-1, G)).view(-1)
    loss, _ = F.policy_loss(logp, logp.detach(), adv, mask, eps_low=0.2, eps_high=0.28,
                            aggregation="token_mean", ref_logprobs=ref_logp, kl_coef=0.04)
    loss.backward()
    for accumulated, parameter in zip(optimizer.grads[0], policy.parameters(), strict=True):
        torch.testing.assert_close(accumulated, parameter.grad, rtol=1e-5, atol=1e-7)
    assert any(g.abs().sum() > 0 for g in optimizer.grads[0])
