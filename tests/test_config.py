import re

import pytest

from hvd_train.config import ALIASES, Config, ConfigError, config_from_dict, parse_config


def test_every_flag_has_a_default_so_a_bare_run_trains():
    assert parse_config([]) == Config()


def test_short_flags_and_section_fields_set_the_same_values():
    cfg = parse_config(["--epochs", "3", "--batch-size=8", "--lr", "0.5", "--seed", "9", "--output-dir", "out"])
    assert (cfg.optim.epochs, cfg.optim.batch_size, cfg.optim.lr, cfg.run.seed, cfg.run.output_dir) == \
        (3, 8, 0.5, 9, "out")
    cfg = parse_config(["--optim.epochs=3", "--optim.batch_size", "8", "--data.val_fraction", "0.25"])
    assert (cfg.optim.epochs, cfg.optim.batch_size, cfg.data.val_fraction) == (3, 8, 0.25)


def test_every_alias_names_a_real_field():
    for flag, dest in ALIASES.items():
        section, name = dest.split(".")
        assert hasattr(getattr(Config(), section), name), flag


@pytest.mark.parametrize("argv,field", [
    (["--epochs", "0"], "optim.epochs"),
    (["--batch-size", "0"], "optim.batch_size"),
    (["--lr", "-1"], "optim.lr"),
    (["--momentum", "1.0"], "optim.momentum"),
    (["--data.val_fraction", "1.5"], "data.val_fraction"),
    (["--workers", "-1"], "data.workers"),
    (["--output-dir", ""], "run.output_dir"),
    (["--freeze-timeout", "5"], "run.freeze_timeout_s"),
    (["--freeze-timeout", "inf"], "run.freeze_timeout_s"),
])
def test_invalid_values_name_the_field(argv, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        parse_config(argv)


def test_unknown_flags_and_bad_types_are_config_errors():
    with pytest.raises(ConfigError, match="unrecognized"):
        parse_config(["--learning-rate", "0.1"])
    with pytest.raises(ConfigError, match="invalid float value"):
        parse_config(["--lr", "fast"])


def test_help_lists_each_field_with_its_comment(capsys):
    with pytest.raises(SystemExit) as exc:
        parse_config(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert "--batch-size INT, --optim.batch_size INT" in out
    assert "samples per rank per backward pass" in out
    assert "--amp {off,bf16,fp16}" in out


def test_config_round_trips_to_json():
    import json

    cfg = parse_config(["--epochs", "4"])
    assert json.loads(cfg.to_json())["optim"]["epochs"] == 4


def write_recipe(tmp_path, text):
    path = tmp_path / "recipe.yaml"
    path.write_text(text)
    return str(path)


def test_yaml_recipe_sets_values_and_the_command_line_overrides_it(tmp_path):
    recipe = write_recipe(tmp_path, "optim:\n  epochs: 7\n  lr: 1\n  lr_milestones: [2, 4]\n"
                                    "horovod:\n  fp16_allreduce: true\ndata:\n  dataset: synthetic\n")
    cfg = parse_config(["--config", recipe, "--epochs", "3"])
    assert cfg.optim.epochs == 3 and cfg.optim.lr == 1.0 and cfg.optim.lr_milestones == (2, 4)
    assert cfg.horovod.fp16_allreduce is True and cfg.data.dataset == "synthetic"
    assert cfg.run.name == "recipe"


@pytest.mark.parametrize("text,message", [
    ("optim:\n  epoch: 3\n", "unknown key optim.epoch"),
    ("optimizer:\n  lr: 3\n", "unknown section 'optimizer'"),
    ("optim:\n  epochs: ten\n", "optim.epochs: expected int, got str 'ten'"),
    ("optim:\n  lr_milestones: [a]\n", "optim.lr_milestones: expected tuple of whole numbers"),
    ("horovod:\n  sync_bn: 1\n", "horovod.sync_bn: expected bool, got int"),
    ("optim: [1, 2]\n", "section 'optim' must be a mapping"),
    ("optim:\n  epochs: 0\n", "optim.epochs (--epochs)=0"),
    ("optim: {epochs: 3\n", "not valid YAML"),
])
def test_bad_recipes_name_the_key_and_the_problem(tmp_path, text, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        parse_config(["--config", write_recipe(tmp_path, text)])


def test_missing_recipe_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="no such file"):
        parse_config(["--config", str(tmp_path / "nope.yaml")])


def test_shipped_recipes_parse(tmp_path):
    import glob
    import os

    recipes = glob.glob(os.path.join(os.path.dirname(__file__), "..", "configs", "*.yaml"))
    assert recipes
    for recipe in recipes:
        parse_config(["--config", recipe])


@pytest.mark.parametrize("argv,message", [
    (["--amp", "fp8"], "invalid choice: 'fp8'"),
    (["--optimizer", "lamb"], "invalid choice: 'lamb'"),
    (["--batches-per-allreduce", "0"], "horovod.batches_per_allreduce"),
    (["--evaluate"], "needs a checkpoint"),
    (["--optim.lr_milestones", "60,30"], "optim.lr_milestones"),
    (["--use-adasum", "--horovod.gradient_predivide_factor", "2"], "horovod.use_adasum"),
])
def test_invalid_combinations_are_refused(argv, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        parse_config(argv)


def test_boolean_flags_work_alone_or_with_a_value():
    assert parse_config(["--download"]).data.download is True
    assert parse_config(["--sync-bn", "false"]).horovod.sync_bn is False
    assert parse_config(["--logging.progress=no"]).logging.progress is False


def test_config_rebuilds_from_its_dict():
    cfg = parse_config(["--epochs", "4", "--optim.lr_milestones", "1,2"])
    assert config_from_dict(cfg.to_dict()) == cfg
