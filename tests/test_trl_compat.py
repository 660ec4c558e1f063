"""TRL's names translate to posttrain's with the values worked out by hand here, and the TRL configs of
examples/trl/ run."""

from __future__ import annotations

from pathlib import Path

import pytest

from posttrain.cli import main
from posttrain.config import Config, ConfigError, resolve

ROOT = Path(__file__).resolve().parents[1]


def test_grpo_batch_in_completions_becomes_prompts_per_step():
    # 8 completions per device x 2 accumulation steps = 16 completions per generation; / 4 per group = 4 prompts
    config = Config.from_flat({"per_device_train_batch_size": 8, "gradient_accumulation_steps": 2,
                               "num_generations": 4})
    assert (config.rollout.prompts_per_step, config.rollout.group_size, config.optim.micro_batch_size) == (4, 4, 8)
    assert config.preset().mini_batches == 1  # the preset's: one optimizer step per generation, as in TRL
    # steps_per_generation 8 with accumulation 2: 8 x 4 = 32 completions = 4 prompts of 8, in 8 / 2 = 4 updates
    config = Config.from_flat({"per_device_train_batch_size": 4, "gradient_accumulation_steps": 2,
                               "steps_per_generation": 8})
    assert (config.rollout.prompts_per_step, config.preset().mini_batches) == (4, 4)
    # generation_batch_size 64 = 8 prompts of 8, micro-batches of 16: 4 micro-steps, 1 per optimizer step
    config = Config.from_flat({"generation_batch_size": 64, "per_device_train_batch_size": 16})
    assert (config.rollout.prompts_per_step, config.preset().mini_batches, config.optim.micro_batch_size) == (8, 4, 16)


def test_grpo_loss_settings_translate_to_the_pieces():
    resolved = resolve({"loss_type": "dr_grpo", "scale_rewards": False, "epsilon": 0.1, "num_iterations": 2,
                        "importance_sampling_level": "sequence", "delta": 3.0, "mask_truncated_completions": True})
    preset = resolved.config.preset()
    assert (preset.aggregation, preset.advantage, preset.eps_low, preset.eps_high) == ("constant", "group_mean", 0.1, 0.1)
    assert (preset.num_epochs, preset.ratio, preset.dual_clip, preset.overlong_filter) == (2, "sequence", 3.0, True)
    assert "epsilon 0.1 -> eps_low 0.1 and eps_high 0.1 (no epsilon_high given)" in resolved.notes
    preset = Config.from_flat({"loss_type": "grpo", "epsilon": 0.2, "epsilon_high": 0.28}).preset()
    assert (preset.aggregation, preset.eps_low, preset.eps_high) == ("sequence_mean", 0.2, 0.28)
    assert Config.from_flat({"loss_type": "dapo", "scale_rewards": "group"}).preset().aggregation == "token_mean"
    assert Config.from_flat({"scale_rewards": "batch"}).preset().advantage == "group_batch_std"  # Lite PPO's
    sapo = Config.from_flat({"algorithm": "sapo", "sapo_temperature_pos": 0.9, "sapo_temperature_neg": 1.2}).preset()
    assert (sapo.tau_pos, sapo.tau_neg) == (0.9, 1.2)
    # DeepSeek-V3.2's two stabilisers under TRL's names
    preset = Config.from_flat({"use_bias_correction_kl": True, "off_policy_mask_threshold": 0.5}).preset()
    assert (preset.kl_importance_weighted, preset.off_policy_mask) == (True, 0.5)
    with pytest.raises(ConfigError, match="use_bias_correction_kl true: .*'none'"):
        Config.from_flat({"algorithm": "dapo", "use_bias_correction_kl": True})


def test_training_arguments_translate():
    # warmup_ratio 0.1 of 30 rollouts x 1 epoch x 16 mini-batches (dapo) = 480 optimizer steps: ceil(48.0) = 48
    config = Config.from_flat({"algorithm": "dapo", "warmup_ratio": 0.1, "max_steps": 30, "bf16": True,
                               "use_vllm": False, "output_dir": "out", "lr_scheduler_type": "cosine",
                               "save_steps": 5, "eval_steps": 10})
    assert config.optim.warmup_steps == 48 and config.model.mixed_precision == "bf16"
    assert (config.rollout.backend, config.run.output, config.optim.lr_schedule) == ("hf", "out", "cosine")
    assert (config.run.save_every, config.run.eval_every) == (5, 10)
    config = Config.from_flat({"use_peft": True, "lora_alpha": 32, "lora_dropout": 0.05})
    assert (config.model.lora_r, config.model.lora_alpha, config.model.lora_dropout) == (16, 32, 0.05)


def test_dpo_batch_counts_pairs_and_micro_batches_count_sequences():
    config = Config.from_flat({"algorithm": "dpo", "per_device_train_batch_size": 4, "gradient_accumulation_steps": 2,
                               "loss_type": ["sigmoid"], "beta": 0.2, "precompute_ref_log_probs": True})
    assert (config.preference.pairs_per_step, config.optim.micro_batch_size) == (8, 8)  # 4 pairs = 8 sequences
    assert config.preset().beta == 0.2 and config.preference.precompute_reference


@pytest.mark.parametrize("loss_type", ["ipo", ["ipo"]])
def test_ipo_loss_type_is_the_ipo_preset_and_beta_its_tau(loss_type):
    """TRL's ``loss_type ipo`` with ``beta`` is posttrain's ipo preset with that beta: in both, beta is the IPO
    paper's tau, the margin's target 1 / (2 tau) (tests/test_trl_preference_parity.py compares the losses)."""
    resolved = resolve({"algorithm": "ipo", "loss_type": loss_type, "beta": 0.25})
    assert not resolved.problems and resolved.config is not None
    preset = resolved.config.preset()
    assert (preset.name, preset.loss, preset.beta) == ("ipo", "ipo", 0.25)  # not the preset's own tau, 0.5
    assert "loss_type ipo: the ipo preset's loss" in resolved.notes


@pytest.mark.parametrize("flat, message", [
    ({"num_train_epochs": 3}, "num_train_epochs: TRL's name, no posttrain equivalent: passes over the training set"),
    ({"loss_type": "bnpo"}, "aggregation token_mean normalises over the optimizer step's tokens"),
    ({"scale_rewards": "median"}, "scale_rewards 'median': use group, batch, none"),
    ({"algorithm": "ppo", "scale_rewards": "group"}, "ppo uses advantage 'gae'"),
    ({"algorithm": "dpo", "loss_type": "ipo"}, "loss_type 'ipo': TRL's ipo loss is --algorithm ipo, not dpo"),
    ({"algorithm": "ipo", "loss_type": ["sigmoid"]}, "loss_type ['sigmoid']: TRL's sigmoid loss is --algorithm dpo"),
    ({"algorithm": "dpo", "loss_type": "hinge"}, "--algorithm dpo (TRL's sigmoid), ipo (TRL's ipo), odpo, simpo"),
    ({"loss_type": "ipo"}, "loss_type 'ipo': DPOConfig's ipo loss is --algorithm ipo"),
    ({"per_device_train_batch_size": 3, "num_generations": 8}, "3 completions per generation is no whole number"),
    ({"num_generations": 4, "group_size": 8}, "num_generations: TRL's name for group_size, which is also given"),
    ({"disable_dropout": True}, "disable_dropout true: posttrain's online trainer runs the model's own dropout"),
    ({"algorithm": "sft", "disable_dropout": False}, "preference, SFT and reward-model trainers always run without"),
])
def test_names_without_an_equivalent_name_the_nearest_field(flat, message):
    with pytest.raises(ConfigError) as info:
        Config.from_flat(flat)
    assert message in str(info.value)


@pytest.mark.parametrize("algorithm, value", [("dpo", True), ("sft", True), ("reward_model", True), ("grpo", False)])
def test_disable_dropout_as_posttrain_runs_it_is_accepted(algorithm, value):
    """TRL's disable_dropout where it says what posttrain does anyway: the offline trainers run without dropout
    (TRL's DPO default true), the online trainer with the model's own (TRL's GRPO default false)."""
    resolved = resolve({"algorithm": algorithm, "disable_dropout": value})
    assert not resolved.problems and resolved.config is not None
    assert any(note.startswith(f"disable_dropout {value}: as posttrain runs it") for note in resolved.notes)


def test_trl_flags_on_the_command_line_print_what_they_became(capsys):
    assert main(["train", "--num_train_epochs", "1", "--loss_type", "bnpo", "--max-steps", "0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("posttrain: error: 3 problems:") and "max_steps: got 0" in err


@pytest.mark.parametrize("name, algorithm", [("grpo", "grpo"), ("dpo", "dpo")])
def test_the_trl_example_configs_run(name, algorithm, tmp_path, capsys):
    argv = ["train", "--algorithm", algorithm, "--config", str(ROOT / "examples" / "trl" / f"{name}.yaml"),
            "--output", str(tmp_path / "run"), "--report-to", "none", "--no-progress", "--eval-size", "8",
            "--max-steps", "1"]
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "posttrain: TRL's" in err and (tmp_path / "run" / "final_model").is_dir()
