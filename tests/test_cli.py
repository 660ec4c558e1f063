"""The command line: pinned flags, config precedence, errors as one line, the presets views."""

from __future__ import annotations

import dataclasses

import pytest
import yaml

from posttrain.cli import _hyphenated, build_parser, main, resolve_config

PINNED = ["--algorithm", "--model", "--task", "--dataset", "--reward", "--config", "--output", "--max-steps",
          "--save-every", "--resume", "--seed"]


def test_train_help_all_has_the_pinned_flags_and_every_config_and_preset_field(capsys):
    from posttrain.config import SECTIONS

    with pytest.raises(SystemExit):
        main(["train", "--help-all"])
    text = capsys.readouterr().out
    for flag in PINNED + ["--learning-rate", "--group-size", "--eps-high", "--beta", "--history-resampling",
                          "--reward-timeout", "--reward-errors", "--lora-r"]:
        assert flag in text, flag
    for klass in SECTIONS.values():
        for f in dataclasses.fields(klass):
            assert "--" + f.name.replace("_", "-") in text, f.name


def test_train_short_help_shows_the_common_flags_and_three_examples(capsys):
    from posttrain.cli import COMMON_FLAGS

    with pytest.raises(SystemExit) as exit_info:
        main(["train", "-h"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    assert all(flag in text for flag in COMMON_FLAGS) and 18 <= len(COMMON_FLAGS) <= 22
    assert "--eps-high" not in text and "--reward-timeout" not in text
    examples = text.split("examples:")[1]
    assert examples.count("posttrain train --algorithm") == 3
    assert len(text.splitlines()) < 120


def test_preset_fields_show_types_and_choices_and_booleans_are_flag_pairs(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help-all"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--ratio {token,sequence,sequence_token}" in text
    assert "--eps-high FLOAT|none" in text and "--binary-reward LOW,HIGH|none" in text
    assert "--dynamic-sampling, --no-dynamic-sampling" in text and "--gradient-checkpointing, --no-gradient" in text
    assert resolve_config(build_parser().parse_args(_hyphenated(
        ["train", "--algorithm", "dapo", "--no-dynamic-sampling"]))).preset().dynamic_sampling is False
    # the older spelling with a value still works
    assert resolve_config(build_parser().parse_args(_hyphenated(
        ["train", "--algorithm", "dapo", "--dynamic-sampling", "false"]))).preset().dynamic_sampling is False
    assert resolve_config(build_parser().parse_args(_hyphenated(
        ["train", "--algorithm", "dapo", "--binary-reward", "none"]))).preset().binary_reward is None


def test_a_preset_value_of_the_wrong_type_names_the_type_and_choices(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--algorithm", "dapo", "--binary-reward", "off"])
    assert "got 'off'; use LOW,HIGH|none" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["train", "--ratio", "seq"])
    assert "got 'seq'; use one of token, sequence, sequence_token" in capsys.readouterr().err


def test_precedence_defaults_then_yaml_then_flags(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({"algorithm": "dapo", "learning_rate": 3e-5, "eps_high": 0.3, "group_size": 4}))
    args = build_parser().parse_args(["train", "--config", str(path), "--group-size", "6"])
    config = resolve_config(args)
    assert config.algorithm == "dapo"
    assert config.optim.learning_rate == 3e-5  # from YAML
    assert config.rollout.group_size == 6  # the flag wins over YAML
    assert config.preset().eps_high == 0.3 and config.preset().eps_low == 0.2  # override + preset default


def test_repeatable_reward_flag_collects_every_function(tmp_path, reward_file):
    args = build_parser().parse_args(["train", "--reward", f"{reward_file}:sevens", "--reward",
                                      f"{reward_file}:ones", "--reward-weights", "1", "--reward-weights", "0.5"])
    config = resolve_config(args)
    assert config.data.reward == (f"{reward_file}:sevens", f"{reward_file}:ones")
    assert config.data.reward_weights == (1.0, 0.5)


def test_resolved_config_round_trips_through_yaml(tmp_path):
    from posttrain.config import Config, load_yaml, save_yaml

    config = Config.from_flat({"algorithm": "cispo", "eps_high": 3.0, "max_steps": 7, "top_k": 5})
    save_yaml(config, tmp_path / "config.yaml")
    assert Config.from_flat(load_yaml(tmp_path / "config.yaml")) == config


@pytest.mark.parametrize("argv, message", [
    (["train", "--algorithm", "grpoo"], "Did you mean 'grpo'"),
    (["train", "--beta", "-1"], "beta"),
    (["train", "--group-size", "0"], "group_size"),
    (["train", "--algorithm", "dpo", "--eps-high", "0.3"], "eps_high"),
])
def test_bad_input_is_one_line_naming_the_problem(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("posttrain: error:") and message in err
    assert "Traceback" not in err


def test_flags_spelled_with_underscores_as_in_trl_mean_the_same():
    argv = ["train", "--max_steps", "3", "--learning_rate=2e-5", "--eps_high", "0.3", "--group-size", "4"]
    assert _hyphenated(argv) == ["train", "--max-steps", "3", "--learning-rate=2e-5", "--eps-high", "0.3",
                                 "--group-size", "4"]
    assert _hyphenated(["train", "--", "--not_a_flag"]) == ["train", "--", "--not_a_flag"]
    config = resolve_config(build_parser().parse_args(_hyphenated(argv)))
    assert (config.run.max_steps, config.optim.learning_rate, config.preset().eps_high) == (3, 2e-5, 0.3)


def test_a_field_under_its_trl_name_is_translated_on_the_command_line_and_in_yaml(tmp_path, capsys):
    config = resolve_config(build_parser().parse_args(_hyphenated(["train", "--num_generations", "4"])))
    assert config.rollout.group_size == 4
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({"max_completion_length": 64}))
    assert resolve_config(build_parser().parse_args(["train", "--config", str(path)])).rollout.max_new_tokens == 64
    path.write_text(yaml.safe_dump({"max_step": 5}))
    assert main(["train", "--config", str(path)]) == 2
    assert "unknown config field 'max_step' (did you mean 'max_steps'?)" in capsys.readouterr().err


def test_algorithms_lists_every_preset_and_marks_differences(capsys):
    from posttrain.algorithms.presets import ALGORITHMS

    assert main(["algorithms"]) == 0
    table = capsys.readouterr().out
    assert all(name in table for name in ALGORITHMS)
    assert main(["algorithms", "grpo", "dr_grpo"]) == 0
    side = capsys.readouterr().out
    marked = {line.split()[1] for line in side.splitlines() if line.startswith("*")}
    assert {"advantage", "aggregation", "beta"} <= marked
    assert "eps_high" not in marked


@pytest.mark.parametrize("argv, message", [
    (["train", "--learning_rat", "5e-3"], "--learning-rat (did you mean 'learning_rate'?)"),
    (["train", "--lr", "1e-3"], "--lr (did you mean 'learning_rate'?)"),
    (["train", "--max-step", "3"], "--max-step (did you mean 'max_steps'?)"),
])
def test_a_prefix_of_a_flag_is_an_unknown_flag_not_silently_another(argv, message, capsys):
    """argparse takes any unique prefix by default: --learning_rat trained at 5e-3 without a word, and
    --lr 1e-3 was taken as --lr-schedule."""
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_max_steps_zero_is_refused_before_any_model_loads(capsys):
    assert main(["train", "--max-steps", "0"]) == 2
    assert "max_steps: got 0; use 1 or more" in capsys.readouterr().err


def test_a_setting_of_other_presets_says_whose_it_is_and_lists_no_descriptive_fields(capsys):
    assert main(["train", "--alpha", "0.5"]) == 2
    err = capsys.readouterr().err
    assert "alpha: not a setting of 'grpo'; it belongs to odpo" in err
    from posttrain.config import Config, ConfigError

    with pytest.raises(ConfigError) as info:
        Config.from_flat({"learning_rat": 1e-3})
    valid = str(info.value).split("valid fields: ")[1].split(", ")
    assert "eps_high" in valid and not {"name", "paper", "summary"} & set(valid)
    with pytest.raises(ConfigError, match="unknown config field 'paper'"):
        Config.from_flat({"paper": "mine"})


def test_preset_flags_show_each_presets_default_and_every_meaning(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help-all"])
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    assert "--eps-high FLOAT|none online presets: Upper clip bound" in text
    assert "[default: 0.2;" in text and "gspo, gspo_token: 0.0004; dapo: 0.28;" in text
    beta = text.split("--beta FLOAT|none online")[1].split("--num-epochs INT online")[0]
    assert beta.startswith(" presets: KL coefficient") and "preference presets: Reward scale" in beta
    assert "grpo, gdpo, maxrl, deepseek_v32: 0.04" in beta and "simpo: 2.0" in beta and "ipo: 0.5" in beta


def test_the_task_help_names_every_built_in_task():
    """`--task`'s help lists the built-in tasks: a task registered without it would be one a user cannot find."""
    import dataclasses

    from posttrain.config import DataConfig
    from posttrain.data.tasks import TASKS

    help_text = next(f for f in dataclasses.fields(DataConfig) if f.name == "task").metadata["help"]
    assert [name for name in TASKS if name not in help_text] == []
