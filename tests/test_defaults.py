"""Defaults suited to the model and the machine (posttrain.training.defaults): a real model's learning rate,
batch, precision and memory settings, chosen where the user set none, said in the run's first lines; the
tiny built-in models keep the config's defaults. Shapes are read from a config on the meta device: no
weights are built here."""

from __future__ import annotations

import pytest
import torch

from posttrain.config import Config, ConfigError
from posttrain.training.defaults import (
    REAL_MODEL_PARAMETERS,
    ModelShape,
    estimated_peak,
    suit_defaults,
    suited,
)

GiB = 2**30
SMOLLM2 = ModelShape("smollm2", parameters=134_515_008, trainable=134_515_008, layers=30, hidden=576,
                     intermediate=1536, vocab=49152)
CPU = torch.device("cpu")


def test_the_estimate_by_hand():
    """Weights, gradients and AdamW's moments (3 x 4 bytes per trainable parameter), activations of
    16 d + 4 m floats per token per layer times the measured factor (1.4 with adapters, 1.2 training every
    weight), or d per layer and 12 layers' set when checkpointed, and a 1,024-token block of logits with its
    gradient."""
    adapters = ModelShape("m", parameters=1000, trainable=100, layers=2, hidden=10, intermediate=20, vocab=50)
    whole = ModelShape("m", parameters=1000, trainable=1000, layers=2, hidden=10, intermediate=20, vocab=50)
    per_layer = (16 * 10 + 4 * 20) * 4  # 960 bytes per token
    logits = 2 * 8 * 50 * 4
    assert estimated_peak(adapters, 8, checkpointing=False, reference=False) == 4000 + 1200 + 21504 + logits  # 8*2*960*1.4
    assert estimated_peak(whole, 8, checkpointing=False, reference=False) == 4000 + 12000 + 18432 + logits  # 8*2*960*1.2
    assert estimated_peak(adapters, 8, checkpointing=True, reference=True) == (
        8000 + 1200 + 8 * (2 * 10 * 4 + 12 * per_layer) + logits)
    # past 2,048 tokens every scored token's logits, kept for the backward, outgrow the 1,024-token block and
    # its gradient, until they pass the 1 GiB that is kept (then the head recomputes them: the block again)
    assert estimated_peak(adapters, 4096, checkpointing=False, reference=False) == (
        4000 + 1200 + int(4096 * 2 * 960 * 1.4) + 4096 * 50 * 4)
    wide = ModelShape("m", parameters=1000, trainable=100, layers=2, hidden=10, intermediate=20, vocab=100_000)
    assert estimated_peak(wide, 4096, checkpointing=False, reference=False) == (
        4000 + 1200 + int(4096 * 2 * 960 * 1.4) + 2 * 1024 * 100_000 * 4)


def test_a_tiny_model_keeps_the_configs_defaults():
    tiny = ModelShape("tiny", REAL_MODEL_PARAMETERS - 1, REAL_MODEL_PARAMETERS - 1, 3, 128, 352, 18)
    config = Config.from_flat({"model": "tiny-addition"})
    assert suited(config, tiny, CPU, 24 * GiB) == (config, [])


@pytest.mark.parametrize("lora, rate", [(0, 1e-6), (16, 1e-5)])
def test_a_real_model_gets_a_rate_batch_precision_and_budget_that_suit_it(lora, rate, monkeypatch):
    """SmolLM2 on a 24 GiB CPU: TRL's RL rate (ten times under LoRA), the recipe's 16 x 4 batch, bf16 where the
    CPU has it, the largest token budget whose estimate fits in 12 GiB, no checkpointing needed; said in
    one line."""
    from posttrain.training import defaults

    for native in (False, True):
        monkeypatch.setattr(defaults, "bf16_supported", lambda device, native=native: native)
        shape = SMOLLM2 if not lora else ModelShape(**{**SMOLLM2.__dict__, "trainable": 4_884_480})
        config, lines = suited(Config.from_flat({"model": "x", "lora_r": lora}), shape, CPU, 24 * GiB)
        assert config.optim.learning_rate == pytest.approx(rate)
        assert (config.rollout.prompts_per_step, config.rollout.group_size) == (16, 4)
        assert config.model.mixed_precision == ("bf16" if native else "no")
        assert config.optim.max_tokens_per_micro_batch == 4096 and not config.model.gradient_checkpointing
        assert estimated_peak(shape, 4096, checkpointing=False, reference=False) <= 12 * GiB
        assert len(lines) == 1 and lines[0].startswith(f"defaults for smollm2 (135M parameters, {'LoRA' if lora else 'full'}")
        assert f"learning_rate {rate:g}" in lines[0] and "prompts_per_step 16, group_size 4" in lines[0]


def test_settings_the_user_gave_are_kept_and_a_misfit_is_warned_of():
    config = Config.from_flat({"model": "x", "learning_rate": 3e-5, "prompts_per_step": 2, "group_size": 8,
                               "max_tokens_per_micro_batch": 65536, "gradient_checkpointing": False})
    suited_config, lines = suited(config, SMOLLM2, CPU, 24 * GiB)
    assert suited_config.optim == config.optim and suited_config.rollout == config.rollout
    assert suited_config.model.gradient_checkpointing is False
    assert lines[1].startswith("warning: the settings given are estimated to need")


def test_less_memory_turns_checkpointing_on_then_shrinks_the_budget_then_refuses():
    """Less memory: a smaller budget first, then checkpointing before going below 1,024 tokens, then smaller
    budgets with it; below what the smallest step needs the run is refused with the estimate and what would
    fit."""
    fits = lambda memory: suited(Config.from_flat({"model": "x"}), SMOLLM2, CPU, memory)[0]  # noqa: E731
    settings = {gib: (fits(gib * GiB).optim.max_tokens_per_micro_batch, fits(gib * GiB).model.gradient_checkpointing)
                for gib in (24, 12, 8, 6)}
    assert settings == {24: (4096, False), 12: (1024, False), 8: (1024, True), 6: (256, True)}
    with pytest.raises(ConfigError, match="needs about .* GiB for a step of 256 tokens with gradient checkpointing, "
                       "over half of this machine's 4.0 GiB; train LoRA adapters"):
        fits(4 * GiB)


@pytest.mark.parametrize("algorithm, rate", [("dpo", 1e-6), ("sft", 2e-5), ("reward_model", 1e-5)])
def test_each_trainer_gets_its_common_rate_and_keeps_its_batch(algorithm, rate):
    config, _ = suited(Config.from_flat({"model": "x", "algorithm": algorithm}), SMOLLM2, CPU, 24 * GiB)
    assert config.optim.learning_rate == pytest.approx(rate)
    assert config.rollout.prompts_per_step == Config().rollout.prompts_per_step  # online only


def test_a_saved_config_sets_every_field(tmp_path):
    """A resumed run reads its config.yaml, which holds every field: nothing is chosen again."""
    from posttrain.config import load_yaml, save_yaml

    first, _ = suited(Config.from_flat({"model": "x"}), SMOLLM2, CPU, 24 * GiB)
    save_yaml(first, tmp_path / "config.yaml")
    again = Config.from_flat(load_yaml(tmp_path / "config.yaml"))
    assert suited(again, SMOLLM2, CPU, 5 * GiB)[0] == again


def test_memory_the_process_already_holds_counts_against_the_limit():
    """A step's peak is what the process holds before the model loads plus the estimate: 3 GiB held on a
    24 GiB machine leaves 9 GiB of the 12 GiB limit, where SmolLM2's 4,096-token step (9.8 GiB) no longer fits
    and the next budget, 2,400 tokens, does; the line says how much was held."""
    from posttrain.training.defaults import held_memory

    config, lines = suited(Config.from_flat({"model": "x"}), SMOLLM2, CPU, 24 * GiB, held=3 * GiB)
    assert estimated_peak(SMOLLM2, 4096, checkpointing=False, reference=False) > 9 * GiB
    assert estimated_peak(SMOLLM2, 2400, checkpointing=False, reference=False) <= 9 * GiB
    assert config.optim.max_tokens_per_micro_batch == 2400
    assert "(3.0 GiB of it held before the model loads)" in lines[0]
    assert 0 < held_memory(CPU) < 24 * GiB  # this test process's resident set


def test_the_shape_is_read_from_the_models_config_without_weights(tmp_path, capsys):
    """A SmolLM2-sized Llama config directory (no weights in it) is read on the meta device: its parameters
    counted, its defaults chosen and said."""
    from transformers import LlamaConfig

    LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                num_key_value_heads=3, tie_word_embeddings=True, architectures=["LlamaForCausalLM"]).save_pretrained(tmp_path)
    config = suit_defaults(Config.from_flat({"model": str(tmp_path), "device": "cpu"}), None)
    assert config.optim.learning_rate == pytest.approx(1e-6)
    assert f"defaults for {tmp_path} (135M parameters, full fine-tuning)" in capsys.readouterr().err
