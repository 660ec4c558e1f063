"""A sampler with weights of its own samples the weights being trained: after every sync its log-probs of
a probe sequence must match the trainer's (``guards.SyncCheck``), or the run stops."""

from __future__ import annotations

import pytest
import torch
from test_online import make_config

from posttrain.models.logprobs import probe_logprobs
from posttrain.rollout.worker import RolloutWorker
from posttrain.training.guards import SyncCheck, WeightSyncError
from posttrain.training.online import train_step
from posttrain.training.session import OnlineSession


def test_the_gap_is_the_mean_absolute_difference_within_the_coarser_dtypes_tolerance():
    check = SyncCheck(torch.arange(40), torch.float32)
    assert check.probe_ids.tolist() == list(range(32))
    trainer = torch.tensor([-1.0, -2.0, -3.0, -4.0])
    assert check.verify(trainer, trainer + torch.tensor([4e-4, -4e-4, 0.0, 0.0]), "s", "step 1") == pytest.approx(2e-4, rel=1e-4)
    with pytest.raises(WeightSyncError, match=r"the copy: after the weight sync for step 3 its log-probs of the "
                                              r"probe sequence differ from the trainer's by 0.0025 per token on "
                                              r"average \(tolerance 0.001\)"):
        check.verify(trainer, trainer + torch.tensor([0.01, 0.0, 0.0, 0.0]), "the copy", "step 3")
    assert SyncCheck(torch.arange(4), torch.float32, torch.bfloat16).tolerance == 5e-2
    with pytest.raises(WeightSyncError):  # a sampler that answered another sequence
        check.verify(trainer, trainer[:3], "s", "step 1")


def test_probe_logprobs_are_the_models_next_token_logprobs(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    ids = torch.tensor([1, 5, 6, 7, 8])
    logits = model(input_ids=ids[None]).logits[0]
    expected = torch.stack([torch.log_softmax(logits[t], -1)[ids[t + 1]] for t in range(4)])
    assert torch.allclose(probe_logprobs(model, ids), expected, atol=1e-6)


@pytest.mark.parametrize("flat, sampler", [
    ({"sampler_dtype": "bfloat16"}, "the sampling copy"),
    ({"async_rollout": True, "max_staleness": 0}, "the rollout process"),
])
def test_a_working_sync_passes_and_logs_its_gap(flat, sampler, tiny_model_dir, reward_file):
    s = OnlineSession.create(make_config(tiny_model_dir, reward_file, "grpo", **flat))
    try:
        for _ in range(3):
            metrics = train_step(s)
            s.step += 1
    finally:
        s.close()
    assert metrics["sync/logprob_gap"] <= s.sync_check.tolerance
    if "async_rollout" in flat:  # the same weights in the same dtype: float rounding at most
        assert metrics["sync/logprob_gap"] < 1e-5


def test_a_sampling_copy_whose_sync_misses_its_weights_stops_the_run(tiny_model_dir, reward_file, monkeypatch):
    """The copy's parameters() hands the sync detached clones: it copies into tensors the model never reads,
    as a transfer that misnames its tensors would."""
    s = OnlineSession.create(make_config(tiny_model_dir, reward_file, "grpo", sampler_dtype="bfloat16",
                                         learning_rate=3e-2, max_steps=20))
    real = [p.detach().clone() for p in s.sampling_copy.parameters()]
    monkeypatch.setattr(s.sampling_copy, "parameters", lambda *a, **k: iter([p.clone() for p in real]))
    with pytest.raises(WeightSyncError, match="the sampling copy: after the weight sync for step"):
        for _ in range(20):
            train_step(s)
            s.step += 1
    assert s.step >= 1  # it went wrong once the policy had moved


def test_a_rollout_process_that_keeps_its_first_weights_stops_the_run(tiny_model_dir, reward_file, monkeypatch):
    """The weights never reach the rollout process (they are dropped from every request), as in verl's LoRA
    sync that kept the initial policy; the probe still travels."""
    real_submit = RolloutWorker.submit

    def submit_without_weights(self, request):
        request.weights = {} if request.weights is not None else None
        real_submit(self, request)

    monkeypatch.setattr(RolloutWorker, "submit", submit_without_weights)
    s = OnlineSession.create(make_config(tiny_model_dir, reward_file, "grpo", async_rollout=True, max_staleness=0,
                                         learning_rate=1e-2, max_steps=10))
    try:
        with pytest.raises(WeightSyncError, match=r"the rollout process: after the weight sync for step \d+"):
            for _ in range(10):
                train_step(s)
                s.step += 1
    finally:
        s.close()


def test_a_sampling_copy_with_noise_is_not_checked(tiny_model_dir, reward_file):
    s = OnlineSession.create(make_config(tiny_model_dir, reward_file, "grpo", sampler_noise=0.3))
    assert s.sync_check is None and "sync/logprob_gap" not in train_step(s)
