import dataclasses
import re

import pytest

from conftest import assert_refused
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
    # A key given twice is refused with both lines (PyYAML alone keeps the last without a word).
    ("optim:\n  lr: 0.1\noptim:\n  epochs: 2\n", "section optim appears twice, on lines 1 and 3"),
    ("optim:\n  lr: 0.1\n  epochs: 2\n  lr: 0.2\n", "optim.lr appears twice, on lines 2 and 4"),
    ("optim: {lr: 0.1, 'lr': 0.2}\n", "optim.lr appears twice, on lines 1 and 1"),
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

    recipes = glob.glob(os.path.join(os.path.dirname(__file__), "..", "..", "configs", "*.yaml"))
    assert recipes
    for recipe in recipes:
        parse_config(["--config", recipe])


@pytest.mark.parametrize("argv,message", [
    (["--amp", "fp8"], "invalid choice: 'fp8'"),
    (["--optimizer", "adam w"], "optim.optimizer (--opt)"),  # lamb and timm's others are names training.py checks
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


def float_fields():
    """Every float setting, as (section, field): none of them has a use for inf or nan."""
    return [(s.name, f.name) for s in dataclasses.fields(Config) for f in dataclasses.fields(s.type) if f.type is float]


@pytest.mark.parametrize("section,name", float_fields())
@pytest.mark.parametrize("text", ["inf", "-inf", "nan", "1e999"])
def test_every_float_flag_refuses_values_that_are_not_finite(section, name, text):
    with pytest.raises(ConfigError, match=re.escape(f"{section}.{name}") + r".*=(-?inf|nan): must be a finite number"):
        parse_config([f"--{section}.{name}", text])  # `--lr -inf` too: argparse must take -inf as a value


@pytest.mark.parametrize("section,name", float_fields())
@pytest.mark.parametrize("text", [".inf", "-.inf", ".nan", "1.0e+999"])
def test_every_float_in_a_recipe_refuses_values_that_are_not_finite(tmp_path, section, name, text):
    recipe = write_recipe(tmp_path, f"{section}:\n  {name}: {text}\n")
    with pytest.raises(ConfigError, match=re.escape(f"{section}.{name}") + r".*=(-?inf|nan): must be a finite number"):
        parse_config(["--config", recipe])


def test_a_whole_number_too_large_for_a_float_is_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"optim\.lr: .*too large"):
        parse_config(["--config", write_recipe(tmp_path, f"optim:\n  lr: {10 ** 400}\n")])


def test_the_finite_message_names_the_flag_and_a_finite_example():
    with pytest.raises(ConfigError, match=re.escape("optim.lr (--lr)=inf: must be a finite number, e.g. the default "
                                                    "0.025 (base learning rate")):
        parse_config(["--lr", "inf"])


def test_negative_numbers_in_scientific_notation_reach_the_range_check():
    with pytest.raises(ConfigError, match=re.escape("optim.lr (--lr)=-0.001: must be a positive learning rate")):
        parse_config(["--lr", "-1e-3"])


@pytest.mark.parametrize("text", ["", "# nothing but a comment\n\n", "---\n", "{}\n"])
def test_a_recipe_without_settings_is_refused(tmp_path, text):
    recipe = write_recipe(tmp_path, text)
    with pytest.raises(ConfigError, match=re.escape(f"--config {recipe}: holds no settings")):
        parse_config(["--config", recipe])


def test_a_merged_key_may_be_overridden_as_in_yaml_but_not_written_twice(tmp_path):
    recipe = write_recipe(tmp_path, "optim:\n  <<: &base {epochs: 4, lr: 0.5}\n  lr: 0.25\n")
    cfg = parse_config(["--config", recipe])
    assert (cfg.optim.epochs, cfg.optim.lr) == (4, 0.25)
    recipe = write_recipe(tmp_path, "optim:\n  <<: &base {epochs: 4, lr: 0.5}\n  lr: 0.25\n  lr: 0.125\n")
    with pytest.raises(ConfigError, match=re.escape("optim.lr appears twice, on lines 3 and 4")):
        parse_config(["--config", recipe])


def test_a_directory_given_as_recipe_is_named_as_such(tmp_path):
    with pytest.raises(ConfigError, match=re.escape(f"--config {tmp_path}: is a directory; expected a YAML file")):
        parse_config(["--config", str(tmp_path)])


def test_a_recipe_that_is_not_utf8_names_the_line(tmp_path):
    path = tmp_path / "latin1.yaml"
    path.write_bytes("optim:\n  # café\n  epochs: 2\n".encode("latin-1"))
    with pytest.raises(ConfigError, match=re.escape(f"--config {path}: not UTF-8 text (byte 0xe9 on line 2)")):
        parse_config(["--config", str(path)])


def test_an_unreadable_recipe_says_why(tmp_path, monkeypatch):
    import builtins

    recipe = write_recipe(tmp_path, "optim:\n  epochs: 2\n")
    real_open = builtins.open

    def refusing_open(file, *args, **kwargs):  # chmod 000 does not stop root, who runs the tests in containers
        if str(file) == recipe:
            raise PermissionError(13, "Permission denied", recipe)
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", refusing_open)
    with pytest.raises(ConfigError, match=re.escape(f"--config {recipe}: cannot be read (Permission denied)")):
        parse_config(["--config", recipe])


@pytest.mark.parametrize("files,args,message", [
    ({"empty.yaml": b"# only a comment\n"}, ["--config", "{}/empty.yaml"], "--config {}/empty.yaml: holds no settings"),
    ({"twice.yaml": b"optim:\n  lr: 0.1\n  lr: 0.2\n"}, ["--config", "{}/twice.yaml"],
     "--config {}/twice.yaml: optim.lr appears twice, on lines 2 and 3"),
    ({"twice.yaml": b"optim:\n  lr: 0.1\nrun:\n  seed: 1\noptim:\n  epochs: 1\n"}, ["--config", "{}/twice.yaml"],
     "--config {}/twice.yaml: section optim appears twice, on lines 1 and 5"),
    ({}, ["--lr", "inf"], "optim.lr (--lr)=inf: must be a finite number"),
    ({}, ["--lr", "-inf"], "optim.lr (--lr)=-inf: must be a finite number"),
    ({"inf.yaml": b"optim:\n  clip_grad: .inf\n"}, ["--config", "{}/inf.yaml"],
     "optim.clip_grad (--clip-grad)=inf: must be a finite number"),
    ({"dir.yaml/x": b""}, ["--config", "{}/dir.yaml"], "--config {}/dir.yaml: is a directory; expected a YAML file"),
    ({"latin1.yaml": b"optim:\n  # caf\xe9\n"}, ["--config", "{}/latin1.yaml"],
     "--config {}/latin1.yaml: not UTF-8 text (byte 0xe9 on line 2)"),
])
def test_bad_recipes_and_values_stop_the_real_cli_with_one_message(tmp_path, app, files, args, message):
    for name, data in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(data)
    args = [a.replace("{}", str(tmp_path)) for a in args]
    line = assert_refused(app(*args, "--epochs", "1", "--output-dir", tmp_path / "out"))
    assert line.startswith(f"train_hvd.py: error: {message.replace('{}', str(tmp_path))}"), line
    assert not (tmp_path / "out").exists()
