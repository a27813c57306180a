"""Trust boundaries: files from elsewhere are data, the watchdog cannot be switched off from outside, and secrets never
land on disk. Each test reproduces an attack or a bad input with the real commands (a crafted checkpoint, sidecar,
config and recipe against predict, export, evaluate, --init-from and resume; forged datagrams against a real 2-rank
job's watchdog; a credential-bearing URI against a real MLflow server; a tampered archive from a local http.server;
the bombs) and checks that nothing runs, nothing crashes, nothing secret is written, and each gets one line."""
import dataclasses
import functools
import gzip
import http.server
import io
import json
import os
import pickle
import re
import socket
import stat
import struct
import subprocess
import sys
import tarfile
import threading
import tracemalloc
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import QUIET, ROOT, WORKERS, app_output, launch, read_json, run_app
from formats import write_image_folder

from hvd_train.tools import export, predict
from hvd_train.guards import watchdog
from hvd_train.guards import watchdog as stacks
from hvd_train.run.checkpoint import Checkpointer
from hvd_train.config import parse_config
from hvd_train.errors import ConfigError
from hvd_train.files import write_json


# --------------------------------------------------------------------------------------------------------------------
# Files name code only with --trust-code


@pytest.fixture(scope="module")
def trained(digits_run):
    """A real checkpoint: the small CNN on the digits, one epoch, one process (conftest's digits_run)."""
    return digits_run / "checkpoints" / "last.pt"


def crafted(source, dest, change):
    """A copy of checkpoint `source` at `dest`, with change(ckpt) applied: what an attacker hands a user."""
    ckpt = torch.load(source, weights_only=True)
    change(ckpt)
    torch.save(ckpt, dest)
    return str(dest)


def an_image(tmp_path):
    from PIL import Image

    path = tmp_path / "x.png"
    Image.fromarray(np.zeros((8, 8), dtype=np.uint8)).save(path)
    return str(path)


def card_naming_code(marker):
    def change(ckpt):
        ckpt["model_card"]["model"] = "os:system"
        ckpt["model_card"]["model_args"] = {"command": f"touch {marker}"}
    return change


def test_a_checkpoint_whose_card_names_code_runs_nothing_in_predict_or_export(tmp_path, trained, capsys):
    marker = tmp_path / "PWNED"
    evil = crafted(trained, tmp_path / "evil.pt", card_naming_code(marker))
    assert predict.main([evil, an_image(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "model.name='os:system' is an import path" in err and "--trust-code" in err, err
    assert export.main([evil, "--format", "safetensors", "--out", str(tmp_path / "m.safetensors")]) == 2
    err = capsys.readouterr().err
    assert err.count("error:") == 1 and "model.name='os:system'" in err and "Traceback" not in err, err
    assert not marker.exists() and not (tmp_path / "m.safetensors").exists()


def write_plugin(folder, marker):
    """A user's own model module, which leaves `marker` behind when it is imported."""
    (folder / "mynets_trust.py").write_text(
        "import pathlib\n"
        f"pathlib.Path({str(marker)!r}).touch()\n"
        "from models.small_cnn import SmallCNN\n\n\n"
        "def net(in_channels, num_classes, image_size, width=32):\n"
        "    return SmallCNN(in_channels, num_classes, width)\n")


def test_trust_code_lets_a_card_name_the_users_own_model_and_nothing_runs_without_it(
        tmp_path, trained, capsys, monkeypatch):
    marker = tmp_path / "imported"
    write_plugin(tmp_path, marker)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    mine = crafted(trained, tmp_path / "mine.pt", lambda c: c["model_card"].update(model="mynets_trust:net"))
    assert predict.main([mine, an_image(tmp_path), "--json"]) == 2
    assert "model.name='mynets_trust:net' is an import path" in capsys.readouterr().err
    assert not marker.exists()  # refused before the module was imported
    assert predict.main([mine, an_image(tmp_path), "--json", "--trust-code"]) == 0
    assert json.loads(capsys.readouterr().out)[0]["top"] and marker.exists()
    sys.modules.pop("mynets_trust", None)


@pytest.mark.parametrize("section,key,value,named", [
    ("data", "dataset", "os:system", "data.dataset='os:system'"),
    ("data", "train_shards", "pipe:touch {marker}", "data.train_shards='pipe:touch"),
    ("data", "shard_index", "pipe:touch {marker}", "data.shard_index='pipe:touch"),
    ("model", "task", "os:system", "model.task='os:system'")])
def test_exports_stored_config_names_no_code(tmp_path, trained, capsys, section, key, value, named):
    marker = tmp_path / "PWNED"
    evil = crafted(trained, tmp_path / "evil.pt",
                   lambda c: c["config"][section].update({key: value.format(marker=marker)}))
    assert export.main([evil, "--format", "safetensors", "--out", str(tmp_path / "m.safetensors")]) == 2
    err = capsys.readouterr().err
    assert named in err and "--trust-code" in err and "Traceback" not in err, err
    assert not marker.exists()


def test_an_exports_sidecar_names_no_code_and_must_describe_its_own_file(tmp_path, trained, capsys):
    out = tmp_path / "model.safetensors"
    assert export.main([str(trained), "--format", "safetensors", "--out", str(out)]) == 0
    image = an_image(tmp_path)
    assert predict.main([str(out), image]) == 0
    sidecar = Path(str(out) + ".json")
    meta = json.loads(sidecar.read_text())
    marker = tmp_path / "PWNED"
    sidecar.write_text(json.dumps({**meta, "model": "os:system", "model_args": {"command": f"touch {marker}"}}))
    capsys.readouterr()
    assert predict.main([str(out), image]) == 2
    assert "model.name='os:system'" in capsys.readouterr().err and not marker.exists()
    # A sidecar that says another format than its file holds.
    sidecar.write_text(json.dumps({**meta, "format": "torchscript"}))
    assert predict.main([str(out), image]) == 2
    assert "says format 'torchscript', but" in capsys.readouterr().err
    renamed = tmp_path / "model.onnx"
    renamed.write_bytes(out.read_bytes())
    Path(str(renamed) + ".json").write_text(json.dumps(meta))
    assert predict.main([str(renamed), image]) == 2
    assert "is named for onnx" in capsys.readouterr().err


def test_a_card_cannot_make_the_model_larger_than_the_weights_it_holds(tmp_path, trained, capsys):
    huge = crafted(trained, tmp_path / "huge.pt", lambda c: c["model_card"]["model_args"].update(width=10**6))
    tracemalloc.start()
    try:
        assert predict.main([huge, an_image(tmp_path)]) == 2
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert "does not have the weights the file holds" in capsys.readouterr().err
    assert peak < 64 * 2**20  # the model of width 10**6 (terabytes) was never allocated


def test_evaluate_init_from_and_resume_build_from_the_command_line_not_the_file(tmp_path, trained, app):
    marker = tmp_path / "PWNED"

    def change(ckpt):
        card_naming_code(marker)(ckpt)
        ckpt["config"]["data"]["dataset"] = "os:system"
        ckpt["config"]["model"]["name"] = "os:system"
    evil = crafted(trained, tmp_path / "evil.pt", change)
    result = app("--output-dir", tmp_path / "eval", "--evaluate", "--resume", evil)
    assert result.returncode == 0 and "evaluated" in result.stdout, result.stderr
    result = app("--output-dir", tmp_path / "init", "--epochs", "1", "--init-from", evil)
    assert result.returncode == 0 and "loaded 8 of the model's 8 tensors" in result.stdout, result.stderr
    result = app("--output-dir", tmp_path / "resumed", "--epochs", "2", "--resume", evil)
    assert result.returncode == 0 and "resuming after epoch 1" in result.stdout, result.stderr
    assert not marker.exists()


def write_recipe(tmp_path, text):
    path = tmp_path / "recipe.yaml"
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize("text,named", [
    ("model:\n  name: os:system\n", "model.name='os:system' is an import path"),
    ("model:\n  task: os:system\n", "model.task='os:system' is an import path"),
    ("data:\n  dataset: shards\n  train_shards: 'pipe:touch x'\n", "data.train_shards='pipe:touch x' is a pipe:"),
    ("model:\n  name: timm/resnet18\n  args: {checkpoint_path: /tmp/x.pth}\n", "model.args.checkpoint_path")])
def test_a_recipe_names_code_only_with_trust_code_or_the_same_flag(tmp_path, text, named):
    recipe = write_recipe(tmp_path, text)
    with pytest.raises(ConfigError, match=f"--config {recipe}: " + named.replace("(", r"\(").replace(".", r"\.")):
        parse_config(["--config", recipe])
    assert parse_config(["--config", recipe, "--trust-code"]) is not None
    key, value = next((k, v) for k, v in [("model.name", "os:system"), ("model.task", "os:system")] if k in named) \
        if "import path" in named else (None, None)
    if key:  # the same setting given as a flag is the user's own choice
        assert parse_config(["--config", recipe, f"--{key}", value]) is not None


def test_the_shipped_examples_recipes_say_they_need_trust_code(tmp_path, app):
    result = app("--config", ROOT / "examples" / "char_lm" / "char_lm.yaml", "--output-dir", tmp_path)
    assert result.returncode == 2 and "model.name='char_lm:model' is an import path" in result.stderr
    assert "--trust-code" in (ROOT / "examples" / "char_lm" / "README.md").read_text()


# --------------------------------------------------------------------------------------------------------------------
# The watchdog authenticates and survives


@pytest.mark.distributed
def test_forged_and_malformed_datagrams_neither_stop_the_watchdog_nor_change_its_verdict(tmp_path):
    sent = tmp_path / "sent"
    proc = launch("horovodrun-gloo", 2, WORKERS / "watchdog_attack.py", "10", "28", "--", "--output-dir", tmp_path,
                  *QUIET, "--epochs", "3", "--freeze-timeout", "20", check=False,
                  env={"HVD_TEST_SENT": str(sent)})
    output = proc.stdout + proc.stderr
    assert sent.read_text() == "12", output[-3000:]  # six datagrams to each rank's port
    assert proc.returncode != 0, output[-3000:]
    # Rank 1, which froze, is named: the forged "rank 1 is far ahead" did not shift the blame.
    assert output.count("train_hvd.py: error: rank 1 (host localhost) stopped making progress") == 1, output[-3000:]
    # Rank 0's watchdog took none of them as a heartbeat, and says so.
    assert "rank 0's watchdog ignored 6 datagram(s)" in output, output[-3000:]
    assert "3 of another size, 3 with a bad MAC" in output, output[-3000:]


def a_watchdog(peer_machine, peer_address):
    """A Watchdog of rank 0 with a peer, rank 1, built directly (its thread not started): for the rules it applies to
    each datagram."""
    key = os.urandom(32)
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    me = watchdog.Member(0, "a", "machine-a", ("10.0.0.1",), 1, key)
    peer = watchdog.Member(1, "b", peer_machine, (peer_address,), 2, os.urandom(32))
    dog = watchdog.Watchdog(me, [me, peer], sock, 30, "")
    sock.close()
    return dog


def beat(dog, rank, progress, sequence, stack_requests=0):
    body = watchdog.BEAT.pack(rank, progress, sequence, stack_requests)
    return body + dog.mac(body)


def test_a_replayed_or_misaddressed_heartbeat_is_ignored_and_counted():
    dog = a_watchdog("machine-b", "10.0.0.2")
    dog.receive(beat(dog, 1, 5, 1), ("10.0.0.2", 9))
    assert dog.peers[1].progress == 5
    dog.receive(beat(dog, 1, 50, 1), ("10.0.0.2", 9))  # the same sequence number again: a replay
    dog.receive(beat(dog, 1, 50, 2), ("10.0.0.9", 9))  # a valid beat, but not from rank 1's address
    dog.receive(beat(dog, 7, 50, 3), ("10.0.0.2", 9))  # no such rank
    assert dog.peers[1].progress == 5
    assert dog.ignored == {"replayed": 1, "from an address that is not the rank's": 2}


def test_a_peer_s_stack_request_is_answered_once_and_a_forged_one_never(capfd, monkeypatch):
    monkeypatch.setattr(stacks, "_answered", {})
    monkeypatch.setattr(stacks, "_last_dump", -stacks.HOLD_S)
    dog = a_watchdog("machine-b", "10.0.0.2")
    dog.receive(beat(dog, 1, 5, 1, stack_requests=2), ("10.0.0.2", 9))  # its first: sent before we listened
    forged = watchdog.BEAT.pack(1, 5, 2, 7) + bytes(watchdog.MAC_BYTES)
    dog.receive(forged, ("10.0.0.2", 9))
    assert "Python stack" not in capfd.readouterr().err
    dog.receive(beat(dog, 1, 5, 3, stack_requests=3), ("10.0.0.2", 9))
    dog.receive(beat(dog, 1, 6, 4, stack_requests=3), ("10.0.0.2", 9))  # the same request again: answered already
    err = capfd.readouterr().err
    assert err.count("every thread's Python stack, as SIGUSR2 to rank 1, passed on to every rank asked") == 1, err
    assert "test_a_peer_s_stack_request_is_answered_once" in err
    # Another request within HOLD_S of that dump (a launcher that signalled every rank): that dump answers it.
    dog.receive(beat(dog, 1, 7, 5, stack_requests=4), ("10.0.0.2", 9))
    assert "Python stack" not in capfd.readouterr().err and stacks._answered[1] == 4
    monkeypatch.setattr(stacks, "_last_dump", -stacks.HOLD_S)
    dog.receive(beat(dog, 1, 8, 6, stack_requests=5), ("10.0.0.2", 9))
    assert "passed on to every rank" in capfd.readouterr().err


def test_an_address_two_hosts_share_identifies_neither():
    dog = a_watchdog("machine-b", "10.0.0.1")  # docker0's address on both hosts, say
    assert dog.targets == [] and dog.sources[1] == set()


# --------------------------------------------------------------------------------------------------------------------
# No secret on disk or in logs; run files for the owner and group


def files_holding(root, secret):
    return [str(p) for p in Path(root).rglob("*") if p.is_file() and secret.encode() in p.read_bytes()]


@pytest.mark.distributed
def test_a_credential_in_the_mlflow_uri_reaches_no_file_log_or_tracker(tmp_path, server):  # noqa: F811
    uri, _, db = server
    secret = "s3cr3t-pw-4711"
    with_credentials = uri.replace("http://", f"http://alice:{secret}@")
    out = tmp_path / "run"
    proc = run_app("horovodrun-gloo", 2, "--output-dir", out, "--epochs", "2", "--mlflow-uri", with_credentials,
                   "--wandb")
    assert secret not in proc.stdout + proc.stderr
    assert files_holding(out, secret) == [] and files_holding(db.parent, secret) == []
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    run = client.search_runs([client.get_experiment_by_name("hvd-train").experiment_id])[0]
    assert run.data.params["logging.mlflow_uri"] == uri and run.data.metrics["val_acc1"] > 0
    assert read_json(out / "config.json")["logging"]["mlflow_uri"] == uri
    # Owner and group only (the test's umask is 022, which would give 0644 and 0755).
    assert stat.S_IMODE((out / "config.json").stat().st_mode) == 0o640
    assert stat.S_IMODE((out / "checkpoints" / "last.pt").stat().st_mode) == 0o640
    assert stat.S_IMODE((out / "checkpoints").stat().st_mode) == 0o750


def test_a_stricter_umask_is_kept(tmp_path, app):
    previous = os.umask(0o077)
    try:
        assert app("--output-dir", tmp_path, "--epochs", "1").returncode == 0
    finally:
        os.umask(previous)
    assert stat.S_IMODE((tmp_path / "summary.json").stat().st_mode) == 0o600


def test_a_planted_link_at_a_temporary_name_is_never_written_through(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("precious")
    target = tmp_path / "config.json"
    os.symlink(victim, f"{target}.tmp.{os.getpid()}")  # the name the writer used to pick
    write_json(str(target), {"a": 1})
    assert victim.read_text() == "precious" and read_json(target) == {"a": 1}


# --------------------------------------------------------------------------------------------------------------------
# Downloads and archives


def test_every_data_set_downloads_over_https_with_a_published_checksum():
    from hvd_train.data import cifar, mnist, stl10
    from torchvision import datasets

    assert cifar.CIFAR10.url.startswith("https://") and cifar.CIFAR10.md5 == datasets.CIFAR10.tgz_md5
    assert cifar.CIFAR100.url.startswith("https://") and cifar.CIFAR100.md5 == datasets.CIFAR100.tgz_md5
    assert stl10.URL.startswith("https://") and stl10.MD5 == datasets.STL10.tgz_md5
    for spec in (mnist.MNIST, mnist.FASHION_MNIST):
        mirrors = spec.mirrors or [m for m in getattr(datasets, spec.mirrors_of).mirrors if m.startswith("https")]
        assert mirrors and all(m.startswith("https://") for m in mirrors)


@pytest.fixture
def web(tmp_path):
    """A real http.server on loopback serving tmp_path/www; yields (folder, base URL)."""
    www = tmp_path / "www"
    www.mkdir()
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(www))
    handler.log_message = lambda *a: None
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield www, f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


def a_tar(path, members):
    """A .tar.gz with (name, bytes or ("link", target)) members."""
    with tarfile.open(path, "w:gz") as tar:
        for name, content in members:
            info = tarfile.TarInfo(name)
            if isinstance(content, tuple):
                info.type, info.linkname = tarfile.SYMTYPE, content[1]
                tar.addfile(info)
            else:
                info.size = len(content)
                tar.addfile(info, io.BytesIO(content))


def test_a_tampered_cifar_archive_fails_its_checksum_and_leaves_nothing(tmp_path, web):
    from hvd_train.data import cifar
    from hvd_train.errors import DataError

    www, base = web
    a_tar(www / "cifar-10-python.tar.gz", [("cifar-10-batches-py/data_batch_1", b"tampered")])
    spec = dataclasses.replace(cifar.CIFAR10, url=f"{base}/cifar-10-python.tar.gz")
    with pytest.raises(DataError, match="MD5 checksum|not found or corrupted"):
        cifar.download(spec, str(tmp_path / "data"))
    assert not (tmp_path / "data").exists()


@pytest.mark.parametrize("member", [("../escaped.txt", b"x"), ("/tmp/absolute-hvd-test.txt", b"x"),
                                    ("cifar/link", ("link", "/etc/passwd"))])
def test_an_archive_member_outside_the_target_refuses_the_archive(tmp_path, web, member):
    from hvd_train.data.download import fetch
    from hvd_train.errors import DataError
    from torchvision.datasets.utils import calculate_md5

    www, base = web
    a_tar(www / "a.tar.gz", [("cifar/ok.txt", b"fine"), member])
    md5 = calculate_md5(str(www / "a.tar.gz"))  # the archive is exactly the one "published": the checksum passes
    with pytest.raises(DataError, match="refusing to unpack it"):
        fetch("A", [f"{base}/a.tar.gz"], str(tmp_path / "data"), "by hand", md5)
    assert not (tmp_path / "escaped.txt").exists() and not os.path.exists("/tmp/absolute-hvd-test.txt")
    assert not (tmp_path / "data" / "cifar" / "ok.txt").exists()  # nothing of it was unpacked


# --------------------------------------------------------------------------------------------------------------------
# The doctor and the images


def test_the_doctor_refuses_a_host_name_that_ssh_would_read_as_an_option(tmp_path):
    from hvd_train.tools import doctor

    with pytest.raises(SystemExit) as exited:
        doctor.main(["--hosts=-Fx:1"])
    assert "'-Fx': a host name cannot start with '-'" in str(exited.value.code)
    hostfile = tmp_path / "hosts"
    hostfile.write_text("-oProxyCommand slots=1\n")
    with pytest.raises(SystemExit) as exited:
        doctor.main(["-hostfile", str(hostfile)])
    assert f"{hostfile}:1: '-oProxyCommand': a host name cannot start" in str(exited.value.code)


def test_the_doctor_passes_the_host_after_double_dash_with_host_key_checking_on():
    from hvd_train.tools import doctor

    args = doctor.parse_args(["-H", "node1:1", "-p", "2222"])
    command = doctor.Hosts(args).command("node1", "print(1)")
    assert command[command.index("--") + 1] == "node1"
    assert "StrictHostKeyChecking=accept-new" in command and "LogLevel=ERROR" not in command
    assert not any("StrictHostKeyChecking=no" in c for c in command)


def test_the_doctors_wait_for_a_listener_ends(tmp_path):
    from hvd_train.tools import doctor

    silent = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], stdout=subprocess.PIPE,
                              text=True)
    try:
        assert doctor.read_port(silent, 0.2) is None
    finally:
        silent.kill()
        silent.wait()


def test_no_private_key_in_the_checkout_enters_a_docker_build_context(tmp_path):
    from docker.utils.build import exclude_paths

    (tmp_path / ".dockerignore").write_text((ROOT / ".dockerignore").read_text())
    for name in ("keys/id_ed25519", "keys/id_ed25519.pub", "id_rsa", "sub/.ssh/id_ecdsa", "tls/server.pem",
                 "tls/server.key", "train_hvd.py", "docker/id_ed25519.pub"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("x")
    context = set(exclude_paths(str(tmp_path), (tmp_path / ".dockerignore").read_text().splitlines()))
    assert "train_hvd.py" in context and "docker/id_ed25519.pub" in context
    assert not {"keys/id_ed25519", "id_rsa", "sub/.ssh/id_ecdsa", "tls/server.pem", "tls/server.key"} & context


def test_the_images_ssh_keeps_host_key_checking_on():
    conf = (ROOT / "docker" / "prepare-base.sh").read_text()
    assert "StrictHostKeyChecking accept-new" in conf and "StrictHostKeyChecking no" not in conf
    assert "UserKnownHostsFile /dev/null" not in conf


# --------------------------------------------------------------------------------------------------------------------
# Bounded input


def peak_of(call):
    tracemalloc.start()
    try:
        call()
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return peak


def test_a_gzip_bomb_posing_as_mnist_is_refused_from_its_header(tmp_path):
    from hvd_train.errors import DataError
    from hvd_train.data.mnist import read_idx

    bomb = tmp_path / "train-images-idx3-ubyte.gz"
    with gzip.open(bomb, "wb") as f:
        f.write(struct.pack(">HBBIII", 0, 8, 3, 10, 28, 28))
        for _ in range(64):
            f.write(bytes(2**20))  # 64 MiB of zeros after a header that announces 7,840 bytes
    assert bomb.stat().st_size < 2**20

    def read():
        with pytest.raises(DataError, match="longer than its header says"):
            read_idx(str(bomb), 3)
    assert peak_of(read) < 4 * 2**20
    huge = tmp_path / "huge.gz"
    with gzip.open(huge, "wb") as f:
        f.write(struct.pack(">HBBIII", 0, 8, 3, 2**31 - 1, 28, 28))
    with pytest.raises(DataError, match="more than an IDX data set holds"):
        read_idx(str(huge), 3)


def test_a_cifar_pickle_of_shared_references_is_refused_before_it_expands(tmp_path):
    from hvd_train.data.cifar import CIFAR10, read_python_batch
    from hvd_train.errors import DataError

    row = [0] * 3072
    path = tmp_path / "data_batch_1"
    path.write_bytes(pickle.dumps({"data": [row] * 2000, "labels": [0] * 2000}, protocol=2))
    assert path.stat().st_size < 20_000

    def read():
        with pytest.raises(DataError, match="not a CIFAR-10 python-version batch"):
            read_python_batch(str(path), CIFAR10)
    assert peak_of(read) < 8 * 2**20


def test_yaml_aliases_in_a_recipe_are_refused(tmp_path):
    recipe = write_recipe(tmp_path, 'a: &a ["x","x","x","x","x","x","x","x","x"]\n'
                                    'b: &b [*a,*a,*a,*a,*a,*a,*a,*a,*a]\n'
                                    'c: &c [*b,*b,*b,*b,*b,*b,*b,*b,*b]\n'
                                    'optim: {epochs: 2}\n')
    with pytest.raises(ConfigError, match="used again through an alias"):
        parse_config(["--config", recipe])
    big = write_recipe(tmp_path, "# " + "x" * 2**21 + "\noptim: {epochs: 2}\n")
    with pytest.raises(ConfigError, match="which no recipe needs"):
        parse_config(["--config", big])


def png_header_only(path, width, height):
    """A PNG that declares width x height pixels (and holds none): Pillow checks the size when it opens it."""
    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0))
                     + chunk(b"IEND", b""))


def test_an_image_over_pillows_pixel_limit_is_a_bad_file_not_a_crash(tmp_path, app, capfd):
    write_image_folder(tmp_path / "data", per_class=6, size=12)
    png_header_only(tmp_path / "data" / "dog" / "bomb.png", 40000, 40000)
    result = app("--output-dir", tmp_path / "out", "--dataset", "imagefolder", "--data-dir", tmp_path / "data",
                 "--image-size", "12", "--batch-size", "2", "--epochs", "1", "--data.skip_bad_files")
    assert result.returncode == 0 and "left out 1 image(s) that do not decode" in result.stdout, result.stderr
    assert "bomb.png" in result.stdout
    assert predict.main([str(tmp_path / "out"), str(tmp_path / "data" / "dog" / "bomb.png")]) == 2
    err = capfd.readouterr().err
    assert "bomb.png: cannot read this image" in err and "Traceback" not in err


def test_a_stray_file_in_checkpoints_is_left_alone(tmp_path):
    saver = Checkpointer(str(tmp_path), keep_last=1)
    (tmp_path / "epoch_best.pt").write_bytes(b"the user's own")
    for epoch in (1, 2):
        saver.save({"epoch": epoch}, epoch, is_best=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["epoch_0002.pt", "epoch_best.pt", "last.pt"]


@pytest.mark.parametrize("flag,value,named", [("--workers", "100000", "data.workers (--workers)=100000"),
                                              ("--data.shuffle_buffer", "10000000000", "data.shuffle_buffer"),
                                              ("--data.synthetic_samples", "10000000000", "data.synthetic_samples"),
                                              ("--image-size", "100000", "data.image_size (--image-size)=100000")])
def test_settings_that_allocate_per_worker_have_an_upper_bound(flag, value, named):
    with pytest.raises(ConfigError, match=re.escape(named)):
        parse_config([flag, value])


def test_a_shard_index_with_an_absurd_count_or_size_is_refused(tmp_path):
    from hvd_train.errors import DataError
    from hvd_train.data.shards import read_index

    index = {"format": "hvd-train shards", "version": 1, "facts": {"num_classes": 10}, "shards": {"a.tar": 10**12}}
    (tmp_path / "index.json").write_text(json.dumps(index))
    with pytest.raises(DataError, match="sample count 1000000000000 is not a whole number from 0"):
        read_index(str(tmp_path / "index.json"))
    index["shards"]["a.tar"], index["facts"]["num_classes"] = 10, 10**9
    (tmp_path / "index.json").write_text(json.dumps(index))
    with pytest.raises(DataError, match="facts.num_classes 1000000000 is not a whole number from 1"):
        read_index(str(tmp_path / "index.json"))


def run_discovery(path):
    return subprocess.run([sys.executable, str(ROOT / "hostfiles" / "discover_hosts.py")], capture_output=True,
                          text=True, env={**os.environ, "HVD_HOSTS_FILE": str(path)})


def test_a_host_list_others_can_write_is_refused_by_discovery(tmp_path):
    hosts = tmp_path / "hosts.txt"
    hosts.write_text("node1:2\n")
    hosts.chmod(0o644)
    assert run_discovery(hosts).stdout == "node1:2\n"
    hosts.chmod(0o666)
    proc = run_discovery(hosts)
    assert proc.returncode == 1 and proc.stdout == "" and "every user may write it" in proc.stderr
    hosts.chmod(0o644)
    os.chown(hosts, 4242, 4242)
    proc = run_discovery(hosts)
    assert proc.returncode == 1 and "owned by uid 4242" in proc.stderr


def test_a_refused_recipe_under_horovodrun_is_one_line(tmp_path):
    recipe = write_recipe(tmp_path, "model:\n  name: os:system\n")
    proc = run_app("horovodrun-gloo", 2, "--config", recipe, "--output-dir", tmp_path / "out", check=False)
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "Traceback" not in app_output(output)
    assert output.count("model.name='os:system' is an import path") == 1, output[-3000:]
