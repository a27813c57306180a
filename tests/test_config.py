import pytest

from config import ALIASES, Config, ConfigError, parse_config


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
    assert "samples per rank per step" in out


def test_config_round_trips_to_json():
    import json

    cfg = parse_config(["--epochs", "4"])
    assert json.loads(cfg.to_json())["optim"]["epochs"] == 4
