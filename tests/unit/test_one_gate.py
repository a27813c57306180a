"""One gate for every value read from a file (hvd_train/provenance.py, with its rules of what is code, and the
one redactor of hvd_train/errors.py; docs/reliability.md: What is code and what is data).

First a table: every entry point that reads a file from elsewhere (training's --config, --resume and --evaluate of a
handed-over run, export, predict, training and evaluation on shards), against every kind of file it reads (a
recipe, config.json, a checkpoint's stored config and model card, an export's sidecar, a shard index's facts),
carrying each kind of forbidden value (code, a command, the network, a tracking server, a file argument, arguments
that replace a shipped data set's settings, nesting and sizes past their bounds). Each case is refused in one line
with exit 2, imports and runs nothing and sends nothing. An entry point that reads one of these files without the
gate fails its rows here.

Then the attacks of the third security pass that the gate answers, as they were written: export's parity check
rebuilding a shard set whose locations `data.args` replaced, a shard index's own facts reaching a model factory, a
checkpoint whose shared references expand without bound, a recipe that replaces a run, policy strings and joint
sizes past their bounds, and credentials inside a `pipe:` command or an index URL reaching files and logs."""
import json
import os
import shutil
import socket
import subprocess
import sys

import pytest
import torch
import yaml

from conftest import BIN, QUIET, ROOT, TRAIN, assert_refused, job_env, read_json, shard_flags
import test_handed_over_files
from test_handed_over_files import ALLOWANCE, an_image, peak_of_command

from hvd_train.provenance import RecordError, plain
from hvd_train.tools import export, predict
from hvd_train.provenance import judged
from hvd_train.errors import redact_argument, redact_text, redact_values

pytestmark = pytest.mark.xdist_group("one_gate")
listener = test_handed_over_files.listener  # a TCP listener on loopback: yields (its URL, what reached it)


@pytest.fixture(scope="module")
def run(digits_run):
    """A real run directory: the small CNN on the digits, one epoch, one process, and its exports (conftest's)."""
    return digits_run


@pytest.fixture(scope="module")
def shards(digits_shards):
    """The digits as tar shards with their index (hvd-train shard; conftest's)."""
    return digits_shards


@pytest.fixture
def evil(tmp_path, monkeypatch):
    """A module `gate_evil` on the import path whose import leaves MARKER behind; yields the marker's path."""
    marker = tmp_path / "MARKER"
    (tmp_path / "gate_evil.py").write_text(f"import pathlib\npathlib.Path({str(marker)!r}).touch()\n"
                                           "net = sets = Task = print\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield marker
    sys.modules.pop("gate_evil", None)


def nested(levels):
    value = 1
    for _ in range(levels):
        value = {"a": value}
    return value


def shared_bomb(depth=6, width=1000):
    """A value of width**depth leaves made of depth lists, each referring to the one below `width` times: a few
    kilobytes pickled, far more than any memory once expanded (as a JSON summary or a dataclass copy expands)."""
    value = ["x" * 100]
    for _ in range(depth):
        value = [value] * width
    return value


def forbidden_settings(marker, url):
    """{kind of forbidden value: the config sections that carry it}."""
    command = f"pipe:touch {marker}"
    shards = {"dataset": "shards", "train_shards": "t-{0..1}.tar", "val_shards": "v.tar", "shard_index": "i.json"}
    return {
        "a model's import path": {"model": {"name": "gate_evil:net"}},
        "a task's import path": {"model": {"task": "gate_evil:Task"}},
        "a data set's import path": {"data": {"dataset": "gate_evil:sets"}},
        "a pipe: command": {"data": {**shards, "train_shards": command, "shard_index": command}},
        "a command behind braces": {"data": {**shards, "train_shards": f"{{pipe:touch {marker},x}}.tar"}},
        "a network location": {"data": {**shards, "train_shards": f"{url}/t.tar", "shard_index": f"{url}/i.json"}},
        "a tracking server": {"logging": {"mlflow_uri": url}},
        "a file argument": {"model": {"args": {"checkpoint_path": str(marker)}}},
        "arguments replacing a shipped data set's settings": {"data": {**shards, "args": {"shard_index": command}}},
        "a command among a task's arguments": {"model": {"task_args": {"vocabulary": command}}},
        "a location nested among arguments": {"model": {"task_args": {"files": {"train": [f"{url}/a.txt"]}}}},
        "arguments for the default data set": {"data": {"args": {"image_size": 3_000_000}}},
        "nesting past its bound": {"model": {"args": {"deep": nested(40)}}},
        "a sample past its size bound": {"data": {"dataset": "synthetic", "synthetic_channels": 64,
                                                  "image_size": 8192}},
        "a policy past its bound": {"aug": {"aa": "rand-m9-n400000000"}},
        "a setting that replaces a run": {"run": {"overwrite": True}},
    }


def forbidden_card(marker, url):
    """{kind of forbidden value: the model card's fields that carry it}."""
    return {
        "a model's import path": {"model": "gate_evil:net"},
        "a task's import path": {"task": "gate_evil:Task"},
        "a file argument": {"model_args": {"checkpoint_path": str(marker)}},
        "a file argument among the facts": {"facts": {"in_channels": 1, "num_classes": 10, "image_size": 8,
                                                      "pretrained_cfg_overlay": {"file": str(marker)}}},
        "a command among the arguments": {"model_args": {"width": f"pipe:touch {marker}"}},
        "nesting past its bound": {"model_args": {"deep": nested(40)}},
    }


def forbidden_facts(marker, url=None):
    """{kind of forbidden value: the shard index facts that carry it}."""
    return {
        "a file argument": {"extra": {"checkpoint_path": str(marker)}},
        "a known fact overridden": {"extra": {"num_classes": 10**9}},
        "a fact past its bound": {"num_classes": 10**9},
        "a fact of the wrong type": {"in_channels": "3"},
        "nesting past its bound": {"extra": {"deep": nested(40)}},
        "a transform that is none": {"transform": "pickle"},
    }


# Which values each kind of file carries: a recipe all; a run's own record leaves out where it was written, so the
# settings that replace a run are the recipe's alone; export rebuilds data from the stored config, not augmentation.
SETTINGS_IN = {"recipe": None, "config.json": ("a setting that replaces a run",),
               "stored config": ("a setting that replaces a run", "a policy past its bound")}
ENTRIES = [("recipe", "train"), ("config.json", "resume"), ("config.json", "evaluate"), ("stored config", "export"),
           ("card in a checkpoint", "export"), ("card in a checkpoint", "predict"), ("card in a sidecar", "predict"),
           ("shard index facts", "train"), ("shard index facts", "evaluate"), ("weights file", "init-from"),
           ("checkpoint", "resume"), ("checkpoint", "evaluate"), ("checkpoint", "export"), ("checkpoint", "predict")]


def forbidden_structures(marker=None, url=None):
    """{kind of forbidden value: what a checkpoint or weights file holds besides its tensors}."""
    return {"shared references": shared_bomb(), "nesting past its bound": nested(40), "an object": {1, 2},
            "a tensor its strides repeat": torch.zeros(1).expand(10**11)}


def cases():
    settings, card, facts, structures = (list(f("M", "http://x")) for f in (
        forbidden_settings, forbidden_card, forbidden_facts, forbidden_structures))
    for kind, entry in ENTRIES:
        if kind in SETTINGS_IN:
            values = [v for v in settings if v not in (SETTINGS_IN[kind] or ())]
        elif kind in ("weights file", "checkpoint"):
            values = structures
        else:
            values = card if kind.startswith("card") else facts
        for value in values:
            yield pytest.param(kind, entry, value, id=f"{entry}-{kind}-{value}".replace(" ", "_"))


def planted(kind, value, run, tmp_path, marker, url):
    """Where `value` is planted in a file of `kind`, copied from the real run: what the entry point reads."""
    given = tmp_path / "given"
    shutil.copytree(run, given)
    if kind in ("recipe", "config.json"):
        sections = forbidden_settings(marker, url)[value]
        if kind == "recipe":
            (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(sections))
            return tmp_path / "recipe.yaml"
        config = read_json(given / "config.json")
        for section, fields in sections.items():
            config.setdefault(section, {}).update(fields)
        (given / "config.json").write_text(json.dumps(config))
        return given
    checkpoint = given / "checkpoints" / "last.pt"
    if kind == "weights file":
        torch.save({"features.0.weight": torch.zeros(32, 1, 3, 3), "notes": forbidden_structures()[value]},
                   tmp_path / "weights.pt")
        return tmp_path / "weights.pt"
    if kind == "checkpoint":
        for name in ("last.pt", "best.pt"):
            ckpt = torch.load(given / "checkpoints" / name, weights_only=True)
            ckpt["history"] = ckpt["history"] + [{"epoch": 1, "notes": forbidden_structures()[value]}]
            os.remove(given / "checkpoints" / name)  # best.pt may be a hard link of last.pt
            torch.save(ckpt, given / "checkpoints" / name)
        return given
    if kind in ("stored config", "card in a checkpoint"):
        ckpt = torch.load(checkpoint, weights_only=True)
        if kind == "stored config":
            for section, fields in forbidden_settings(marker, url)[value].items():
                ckpt["config"].setdefault(section, {}).update(fields)
        else:
            ckpt["model_card"].update(forbidden_card(marker, url)[value])
        torch.save(ckpt, checkpoint)
        return checkpoint
    if kind == "card in a sidecar":
        model = given / "export" / "model.safetensors"
        sidecar = read_json(f"{model}.json")
        sidecar.update(forbidden_card(marker, url)[value])
        (given / "export" / "model.safetensors.json").write_text(json.dumps(sidecar))
        return model
    return given  # shard index facts: planted by the caller in a copy of the shards


def entered(entry, kind, where, run, tmp_path, app, capfd, index_dir):
    """Run `entry` on the planted file; returns (exit code, output)."""
    out = tmp_path / "out"
    if entry in ("export", "predict"):
        args = [str(where), "--format", "safetensors", "--out", str(out / "m.safetensors")] if entry == "export" \
            else [str(where), an_image(tmp_path / "x.png")]
        capfd.readouterr()
        code = (export if entry == "export" else predict).main(args)
        captured = capfd.readouterr()
        return code, captured.out + captured.err
    if kind == "checkpoint" and entry in ("export", "predict"):
        return entered(entry, "card in a checkpoint", where / "checkpoints" / "best.pt", run, tmp_path, app, capfd,
                       index_dir)
    if kind == "weights file":
        args = ["--init-from", where, "--output-dir", out]
    elif kind == "shard index facts":
        args = [*shard_flags(index_dir, "train-{000000..000003}.tar", "val-000000.tar"), "--output-dir", out]
        if entry == "evaluate":
            args += ["--evaluate", "--resume", run / "checkpoints" / "last.pt"]
    elif kind == "recipe":
        args = ["--config", where, "--output-dir", out]
    elif entry == "resume":
        args = ["--output-dir", where, "--resume", "auto", "--epochs", "2"]
    else:
        args = ["--output-dir", out, "--evaluate", "--resume", where / "checkpoints" / "last.pt"]
    result = app(*args)
    return result.returncode, result.stdout + result.stderr


@pytest.mark.parametrize("kind,entry,value", list(cases()))
def test_every_entry_point_refuses_every_forbidden_value_of_every_file_it_reads(
        kind, entry, value, run, shards, tmp_path, app, capfd, evil, listener):
    url, connections = listener
    marker = evil
    where = planted(kind, value, run, tmp_path, marker, url)
    index_dir = None
    if kind == "shard index facts":
        index_dir = tmp_path / "shards"
        shutil.copytree(shards, index_dir)
        index = read_json(index_dir / "index.json")
        index["facts"].update(forbidden_facts(marker)[value])
        (index_dir / "index.json").write_text(json.dumps(index))
    code, output = entered(entry, kind, where, run, tmp_path, app, capfd, index_dir)
    errors = [line for line in output.splitlines() if "error:" in line]
    assert code == 2 and len(errors) == 1 and "Traceback" not in output, output[-3000:]
    assert not marker.exists(), f"{entry} ran what {kind} named ({value})"
    assert not connections, f"{entry} reached the network {kind} named ({value})"
    assert not (tmp_path / "out" / "m.safetensors").exists()


# --------------------------------------------------------------------------------------------------------------------
# The attacks the gate answers, as they were written


def test_export_of_a_received_run_runs_no_command_that_data_args_put_in_place_of_the_shards(tmp_path, run):
    """Attack 1: export's parity check rebuilt the data set from the stored config, whose data.args replaced the
    shipped `shards` factory's locations with a command."""
    given = tmp_path / "received"
    shutil.copytree(run, given)
    marker = tmp_path / "PWNED"
    checkpoint = given / "checkpoints" / "best.pt"
    ckpt = torch.load(checkpoint, weights_only=True)
    command = f"pipe:touch {marker}; cat /dev/null"
    ckpt["config"]["data"].update(dataset="shards", train_shards="t.tar", val_shards="v.tar",
                                  args={"train_shards": command, "val_shards": command, "shard_index": command})
    torch.save(ckpt, checkpoint)
    os.remove(given / "export" / "model.onnx")  # the shared run was exported: none may be written again
    proc = subprocess.run([BIN / "hvd-train", "export", given, "--format", "onnx"], cwd=ROOT, env=job_env(),
                          capture_output=True, text=True, timeout=600)
    lines = [line for line in proc.stderr.splitlines() if "hvd-train export: error:" in line]
    assert proc.returncode == 2 and len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "data.args" in lines[0] and "--trust-code" in lines[0], lines[0]
    assert not marker.exists() and not (given / "export" / "model.onnx").exists()


def write_index_with_extra(source, dest, extra):
    shutil.copytree(source, dest)
    index = read_json(dest / "index.json")
    index["facts"]["extra"] = extra
    (dest / "index.json").write_text(json.dumps(index))
    return dest


@pytest.mark.parametrize("extra,named", [({"checkpoint_path": "/etc/passwd"}, "facts.extra.checkpoint_path"),
                                         ({"num_classes": 3}, "facts.extra.num_classes")])
def test_a_shard_indexs_own_facts_never_choose_a_file_or_override_the_bounded_ones(
        tmp_path, app, shards, extra, named):
    """Attack 4: facts.extra reached the model factory unchecked (timm read checkpoint_path) and overrode the
    bounded num_classes, in_channels and image_size."""
    planted_dir = write_index_with_extra(shards, tmp_path / "shards", extra)
    result = app(*shard_flags(planted_dir, "train-{000000..000003}.tar", "val-000000.tar"), "--model",
                 "timm/resnet18", "--output-dir", tmp_path / "out", "--epochs", "1")
    assert_refused(result, named, "hvd-train shard")
    assert not (tmp_path / "out").exists()


def test_a_shard_indexs_own_facts_do_not_size_a_model_that_ships(tmp_path, app, shards):
    """Attack 4: a width among an index's facts made the small CNN (which takes a width) allocate gigabytes. The
    index's own facts reach only the user's own factories, by name."""
    planted_dir = write_index_with_extra(shards, tmp_path / "shards", {"width": 200_000, "hidden": 10**9})
    result = app(*shard_flags(planted_dir, "train-{000000..000003}.tar", "val-000000.tar"), "--output-dir",
                 tmp_path / "out", "--epochs", "1", "--batch-size", "64")
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    weights = torch.load(tmp_path / "out" / "checkpoints" / "last.pt", weights_only=True)["model"]
    assert weights["features.0.weight"].shape[0] == 32  # the small CNN's own width, not the index's


def test_the_gate_counts_every_reference_to_a_shared_value():
    with pytest.raises(RecordError, match="more than"):
        plain({"history": shared_bomb()}, "a file")
    with pytest.raises(RecordError, match="nest more than"):
        plain(nested(40), "a file")
    with pytest.raises(RecordError, match="not plain data"):
        plain({"x": object()}, "a file")
    assert plain({"model": {"w": torch.zeros(3)}, "rng": [(3, tuple(range(625)), None)]}, "a file")


@pytest.fixture(scope="module")
def bombed(run, tmp_path_factory):
    """A copy of the run whose checkpoints' history and card hold shared references that expand without bound."""
    given = tmp_path_factory.mktemp("bombed") / "run"
    shutil.copytree(run, given)
    for name in ("last.pt", "best.pt"):
        checkpoint = given / "checkpoints" / name
        ckpt = torch.load(checkpoint, weights_only=True)
        ckpt["history"] = ckpt["history"] + [{"epoch": 2, "notes": shared_bomb()}]
        ckpt["model_card"]["classes"] = shared_bomb(5)
        os.remove(checkpoint)  # best.pt may be a hard link of last.pt
        torch.save(ckpt, checkpoint)
    assert (given / "checkpoints" / "last.pt").stat().st_size < 2 * 2**20
    return given


@pytest.mark.parametrize("command", ["predict", "export", "resume"])
def test_a_checkpoint_whose_shared_references_expand_is_refused_within_memory(tmp_path, run, bombed, command):
    """Attack 6: shared references in a checkpoint's plain values (card, history) expanded without bound: a
    1.2 MB checkpoint ran export, predict and --resume out of memory."""
    image = an_image(tmp_path / "x.png")

    def argv(source):
        if command == "predict":
            return [BIN / "hvd-train", "predict", source, image]
        if command == "export":
            return [BIN / "hvd-train", "export", source, "--format", "safetensors", "--out", tmp_path / "m.st"]
        copy = tmp_path / f"copy-{source.parent.name}"
        shutil.copytree(source, copy)
        return [sys.executable, TRAIN, *QUIET, "--output-dir", copy, "--resume", "auto", "--epochs", "2"]

    benign_code, _, benign_peak = peak_of_command(argv(run), tmp_path)
    assert benign_code == 0
    if command == "export":
        os.remove(tmp_path / "m.st")
    code, output, peak = peak_of_command(argv(bombed), tmp_path)
    program = "train_hvd.py" if command == "resume" else f"hvd-train {command}"
    lines = [line for line in output.splitlines() if f"{program}: error:" in line]
    assert code == 2 and len(lines) == 1 and "Traceback" not in output, output[-3000:]
    assert "counting each reference to a shared" in lines[0], lines[0]
    assert peak < benign_peak + ALLOWANCE, (peak, benign_peak)


@pytest.mark.parametrize("setting,named", [({"overwrite": True}, ("run.overwrite", "command line")),
                                           ({"output_dir": "somewhere-else"}, ("already holds a run",))])
def test_a_recipe_never_replaces_or_moves_a_run(tmp_path, app, run, setting, named):
    """Attack 12: a recipe setting run.overwrite replaced a user's earlier run and deleted its checkpoints."""
    given = tmp_path / "mine"
    shutil.copytree(run, given)
    before = sorted(p.name for p in (given / "checkpoints").iterdir())
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({"run": setting, "optim": {"epochs": 1}}))
    assert_refused(app("--config", recipe, "--output-dir", given), *named)  # its output_dir is left out
    assert sorted(p.name for p in (given / "checkpoints").iterdir()) == before
    assert not (ROOT / "somewhere-else").exists()


@pytest.mark.parametrize("sections,named", [
    ({"aug": {"aa": "rand-m9-n400000000"}}, "n400000000 is past 16"),
    ({"aug": {"aa": "augmix-m5-w4000000-d2"}}, "w4000000 is past 16"),
    ({"data": {"dataset": "synthetic", "synthetic_channels": 64, "image_size": 8192}}, "268,435,456"),
    ({"optim": {"batch_size": 10**8}}, "values per rank")])
def test_sizes_a_recipe_sets_are_bounded_together(tmp_path, app, sections, named):
    """Attack 13: timm policy strings took 4 GB and ended in a traceback; synthetic channels and the image size
    were bounded one at a time, not together."""
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(sections))
    assert_refused(app("--config", recipe, "--output-dir", tmp_path / "out"), named)
    assert not (tmp_path / "out").exists()


SECRETS = ("s3cret", "tok123")


def test_credentials_inside_a_pipe_command_reach_no_file_and_no_log(tmp_path, app, shards):
    """Attack 14: credentials inside a pipe: command given on the command line were stored in config.json and
    every checkpoint."""
    train = f"pipe:env MIRROR=https://bob:s3cret@127.0.0.1/x?token=tok123 cat {shards}/train-{{000000..000003}}.tar"
    val = f"pipe:cat {shards}/val-000000.tar"
    result = app("--dataset", "shards", "--data.train_shards", train, "--data.val_shards", val, "--data.shard_index",
                 shards / "index.json", "--output-dir", tmp_path / "out", "--epochs", "1")
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    assert not any(s in result.stdout + result.stderr for s in SECRETS)
    stored = read_json(tmp_path / "out" / "config.json")["data"]["train_shards"]
    assert "bob" not in stored and "REDACTED" in stored and stored.endswith("train-{000000..000003}.tar"), stored
    for path in (tmp_path / "out").rglob("*"):
        if path.is_file():
            data = path.read_bytes()
            assert not any(s.encode() in data for s in SECRETS), path
    ckpt = torch.load(tmp_path / "out" / "checkpoints" / "last.pt", weights_only=True)
    assert not any(s in json.dumps(ckpt["config"]) for s in SECRETS)


def test_error_messages_name_an_index_url_without_its_credentials(tmp_path, app, shards):
    """Attack 15: error messages printed shard and index URLs raw, user info and ?token= included, into job
    logs."""
    port = socket.socket()
    port.bind(("127.0.0.1", 0))
    url = f"http://bob:s3cret@127.0.0.1:{port.getsockname()[1]}/index.json?token=tok123"
    port.close()  # nothing listens there: the index cannot be read
    result = app(*shard_flags(shards, "train-{000000..000003}.tar", "val-000000.tar"), "--data.shard_index", url,
                 "--output-dir", tmp_path / "out")
    line = assert_refused(result, "shard index", "127.0.0.1")
    assert not any(s in result.stdout + result.stderr for s in SECRETS), line


def test_the_rules_reach_every_string_nested_in_arguments_and_the_default_data_set():
    found = judged({"model": {"task_args": {"files": {"train": ["http://x/a", "b"]}}}})
    assert [setting for setting, _, _ in found] == ["model.task_args.files.train[0]"], found
    assert [s for s, _, _ in judged({"data": {"args": {"image_size": 3}}})] == ["data.args"]  # digits, the default
    assert not judged({"data": {"args": {"image_size": 3}}}, dataset="mine.sets:build")  # the user's own factory


def test_a_model_card_is_stored_through_the_redactor():
    """What every checkpoint and export's .json keeps of the model's arguments: no credential of a URI in them."""
    from types import SimpleNamespace

    from hvd_train.config import parse_config
    from hvd_train.data import DataInfo
    from hvd_train.run.model_card import card_for

    cfg = parse_config(["--model-args", "weights_url=https://bob:s3cret@h/w.pt?token=tok123"])
    card = card_for(cfg, DataInfo(1, 10, 8, 100, 20), SimpleNamespace(name="classification")).to_dict()
    assert card["model_args"] == {"weights_url": "https://h/w.pt?token=REDACTED"}, card


def test_the_redactor_finds_credentials_anywhere_in_a_text():
    assert redact_text("pipe:curl -s https://bob:s3cret@h/a.tar?token=tok123") == \
        "pipe:curl -s https://h/a.tar?token=REDACTED"
    assert "s3cret" not in redact_text("pipe:curl -u bob:s3cret https://h/a.tar")
    assert "tok123" not in redact_text('curl -H "Authorization: Bearer tok123" https://h/a.tar')
    assert redact_values({"data": {"args": {"url": "gs://b/x?sig=tok123"}}, "n": [1, "a"]}) == \
        {"data": {"args": {"url": "gs://b/x?sig=REDACTED"}}, "n": [1, "a"]}
    assert redact_text("plain words: a:b c") == "plain words: a:b c"
    for word in ("pipe:curl -s https://bob:s3cret@h/x.tar", "--data.train_shards=pipe:curl -u bob:s3cret h/x.tar"):
        assert "s3cret" not in redact_argument(word), word  # what W&B records of the command line
