"""--dataset shards: WebDataset tar shards written by `hvd-train shard`, read from disk or a real HTTP server,
with exact epochs: disjoint shards per rank, the same number of steps on every rank, every validation sample once,
bitwise resume and an elastic reset that re-reads the epoch whole."""
import functools
import http.server
import json
import subprocess
import tarfile
import threading
from collections import Counter

import pytest
import torch

from conftest import (BIN, QUIET, ROOT, TRAIN, WORKERS, assert_refused, job_env, launch, offline_shell, read_json,
                      run_app, shard, shard_flags)
from hvd_train.data import BadSampleError, DataError, LoaderSpec, build_loaders, check_world
from hvd_train.data.shards import ShardSet, train_plan
from formats import write_image_folder
from hvd_train.config import DataConfig
from hvd_train.data import build_datasets
from conftest import elastic_run_losing_a_worker


def sets(out, **kw):
    dc = DataConfig(dataset="shards", train_shards=f"{out}/train-{{000000..000004}}.tar",
                    val_shards=f"{out}/val-{{000000..000001}}.tar", **kw)
    return build_datasets(dc)


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass  # a line per request would bury the test's own output


@pytest.fixture
def http_server(tmp_path):
    """A real HTTP server (Python's, on loopback) serving tmp_path/www; yields its base URL."""
    root = tmp_path / "www"
    root.mkdir()
    handler = functools.partial(QuietHandler, directory=str(root))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield root, f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_the_writer_stores_samples_as_they_are_with_an_index(tmp_path, tool):
    write_image_folder(tmp_path / "photos", per_class=5, size=12, ext="jpg")
    out = shard(tmp_path / "shards", "--from", "imagefolder", "--data-dir", tmp_path / "photos", "--shard-size", "4")
    assert f"--data.train_shards '{tmp_path / 'shards'}/train-{{000000..000002}}.tar'" in out, out
    index = json.loads((tmp_path / "shards" / "index.json").read_text())
    assert index["shards"] == {"train-000000.tar": 4, "train-000001.tar": 4, "train-000002.tar": 4,
                               "val-000000.tar": 3}
    assert index["facts"]["classes"] == ["cat", "dog", "owl"] and index["facts"]["transform"] == "photos"
    with tarfile.open(tmp_path / "shards" / "train-000000.tar") as tar:
        names = tar.getnames()
        assert names[:2] == ["000000000.cls", "000000000.jpg"] or names[:2] == ["000000000.jpg", "000000000.cls"]
        data = tar.extractfile(next(n for n in names if n.endswith(".jpg"))).read()
    originals = {p.read_bytes() for p in (tmp_path / "photos").glob("*/*.jpg")}
    assert data in originals  # the JPEG byte for byte, not decoded and encoded again
    proc = tool("shard", "--from", "digits", "--out", tmp_path / "shards")
    assert proc.returncode == 2 and "already holds shards (index.json); choose an empty --out" in proc.stderr


def test_shard_names_its_own_download_flag_and_fetches_with_it(tmp_path):
    """A missing data set's message points at --download; hvd-train shard takes it (offline here: the URL is named
    and nothing is written)."""
    (tmp_path / "data").mkdir()
    command = [str(BIN / "hvd-train"), "shard", "--from", "mnist", "--data-dir", str(tmp_path / "data"),
               "--out", str(tmp_path / "shards")]
    missing = subprocess.run(command, cwd=ROOT, env=job_env(), capture_output=True, text=True, timeout=120)
    assert missing.returncode == 2 and "MNIST not found" in missing.stderr and "--download" in missing.stderr, \
        missing.stderr
    offline = subprocess.run(offline_shell() + command + ["--download"], cwd=ROOT, env=job_env(),
                             capture_output=True, text=True, timeout=300)
    lines = offline.stderr.strip().splitlines()
    assert offline.returncode == 2 and len(lines) == 1 and lines[0].startswith("hvd-train shard: error: --download "
                                                                               "MNIST: cannot fetch https://"), \
        offline.stdout + offline.stderr
    assert not (tmp_path / "shards").exists() and not list((tmp_path / "data").iterdir())


def test_an_epoch_deals_disjoint_shards_and_the_same_steps_to_every_rank(digits_shards):
    train, _, info = sets(digits_shards)
    assert (info.num_train, info.num_val, info.in_channels, info.num_classes) == (1438, 359, 1, 10)
    for epoch in (1, 2):
        for world, workers in ((2, 0), (2, 2), (3, 1), (5, 0)):
            parts, steps = train_plan(train, epoch, 0, world, workers, 32)
            dealt = [i for rank in parts for worker in rank for i in worker]
            assert sorted(dealt) == list(range(5)), (epoch, world, workers)  # each shard once, to one reader
            full = [sum(sum(train.counts[i] for i in w) // 32 for w in rank) for rank in parts]
            assert steps == min(full) > 0
    assert train_plan(train, 1, 0, 2, 0, 32) != train_plan(train, 2, 0, 2, 0, 32)  # a new deal each epoch


def read_epoch(train, val, world, epoch, workers=0, batch=32, image_size=0):
    """Every rank's training batches and validation labels for `epoch`, as the loaders deliver them."""
    ranks = []
    for rank in range(world):
        spec = LoaderSpec(batch, 0, workers, image_size=image_size)
        train_loader, val_loader, sampler = build_loaders(train, val, spec, rank, world)
        sampler.set_epoch(epoch)
        batches = list(train_loader)
        assert len(batches) == len(train_loader), "a rank ran a different number of steps than planned"
        ranks.append((batches, torch.cat([labels for _, labels in val_loader] or [torch.zeros(0)])))
    return ranks


def test_every_rank_runs_the_same_full_batches_and_validation_counts_each_sample_once(digits_shards):
    train, val, _ = sets(digits_shards)
    ranks = read_epoch(train, val, world=2, epoch=3)
    steps = {len(batches) for batches, _ in ranks}
    assert len(steps) == 1 and all(images.shape == (32, 1, 8, 8) for batches, _ in ranks for images, _ in batches)
    # No training sample twice in the epoch: images are told apart by their pixels.
    seen = Counter(tuple(image.flatten().tolist()) for batches, _ in ranks for images, _ in batches for image in images)
    assert sum(seen.values()) == steps.pop() * 32 * 2
    from hvd_train.data.catalog import load_digits_dataset
    digits = load_digits_dataset()
    assert max(seen.values()) <= Counter(tuple(image.flatten().tolist()) for image, _ in digits).most_common(1)[0][1]
    labels = torch.cat([v for _, v in ranks])
    expected = torch.tensor([int(val_label) for _, val_label in build_datasets(DataConfig(dataset="digits"))[1]])
    assert len(labels) == 359 and sorted(labels.tolist()) == sorted(expected.tolist())


def test_loader_workers_read_the_epoch_they_are_told_and_resume_reads_the_same(digits_shards):
    train, val, _ = sets(digits_shards)
    spec = LoaderSpec(32, 0, workers=2)
    loader, _, sampler = build_loaders(train, val, spec, 0, 2)
    sampler.set_epoch(1)
    first = [labels.tolist() for _, labels in loader]
    sampler.set_epoch(2)
    second = [labels.tolist() for _, labels in loader]  # the same worker processes, told the new epoch
    fresh, _, fresh_sampler = build_loaders(train, val, spec, 0, 2)
    fresh_sampler.set_epoch(2)  # as a resumed run starts
    assert [labels.tolist() for _, labels in fresh] == second != first


def test_training_shards_are_augmented_as_their_source_data_set_and_reproducibly(digits_shards):
    from hvd_train.data.augment import Augmentation

    dc = DataConfig(dataset="shards", train_shards=f"{digits_shards}/train-{{000000..000004}}.tar",
                    val_shards=f"{digits_shards}/val-{{000000..000001}}.tar")

    def images(augment, workers=0, epoch=1):
        (batches, val_labels), = read_epoch(*build_datasets(dc, 0, augment)[:2], world=1, epoch=epoch,
                                            workers=workers)
        return [tuple(image.flatten().tolist()) for images, _ in batches for image in images], val_labels

    plain, plain_val = images(None)
    unchanged = set(plain)
    off, off_val = images(Augmentation(enabled=False))  # --no-aug
    assert off == plain and torch.equal(off_val, plain_val)
    augmented, augmented_val = images(Augmentation())  # the digits' default: a small random affine
    # At 8x8 pixels a small rotation or scale often rounds to the same pixels: most, not all, samples change.
    assert sum(image in unchanged for image in augmented) < len(augmented) // 2
    assert torch.equal(augmented_val, plain_val)
    # Seeded per epoch, rank and loader worker: a resumed run's fresh workers draw what an uninterrupted run's drew.
    assert images(Augmentation(), workers=1, epoch=2)[0] == images(Augmentation(), workers=1, epoch=2)[0]


def test_shards_of_unequal_size_never_leave_a_rank_without_a_step(tmp_path):
    # 7 shards (six of 5 samples, one of 2) for 3 ranks: one rank gets 3 shards, the others 2, yet every rank runs
    # as many steps as the poorest has (by design: no rank waits in an allreduce for another that has run out).
    write_image_folder(tmp_path / "photos", classes=("a", "b"), per_class=20, size=8)
    out = tmp_path / "shards"
    shard(out, "--from", "imagefolder", "--data-dir", tmp_path / "photos", "--shard-size", "5")
    index = json.loads((out / "index.json").read_text())
    names = sorted(n for n in index["shards"] if n.startswith("train"))
    train = ShardSet(tuple(str(out / n) for n in names), tuple(index["shards"][n] for n in names), index["facts"],
                     True)
    val = ShardSet((str(out / "val-000000.tar"),), (index["shards"]["val-000000.tar"],), index["facts"], False)
    plan = train_plan(train, 1, 0, 3, 0, 2)[0]
    assert len({sum(train.counts[i] for i in rank[0]) for rank in plan}) > 1  # the ranks' samples differ
    lengths = {len(batches) for batches, _ in read_epoch(train, val, world=3, epoch=1, batch=2, image_size=8)}
    assert len(lengths) == 1 and lengths.pop() > 0


def test_refusals_name_the_setting_and_the_way_out(digits_shards, tmp_path):
    with pytest.raises(DataError, match="--dataset shards needs --data.val_shards"):
        build_datasets(DataConfig(dataset="shards", train_shards=f"{digits_shards}/train-000000.tar"))
    with pytest.raises(DataError, match=r"shard index .*/nowhere/index.json: cannot read it .*hvd-train shard"):
        build_datasets(DataConfig(dataset="shards", train_shards=f"{tmp_path}/nowhere/t-{{0..1}}.tar",
                                  val_shards=f"{tmp_path}/nowhere/v.tar"))
    with pytest.raises(DataError, match="has no entry for train-000005.tar, train-000006.tar, train-000007.tar"):
        build_datasets(DataConfig(dataset="shards", train_shards=f"{digits_shards}/train-{{000000..000007}}.tar",
                                  val_shards=f"{digits_shards}/val-000000.tar"))
    train, _, _ = sets(digits_shards)
    with pytest.raises(DataError, match=r"5 training shard\(s\) cannot feed 8 ranks"):
        check_world(train, 8, LoaderSpec(32, 0))
    with pytest.raises(DataError, match="a step takes 700 samples per rank, but in epoch 1 some rank"):
        check_world(train, 2, LoaderSpec(700, 0))


def test_pipe_commands_stream_shards_with_the_index_named(digits_shards):
    pattern = "pipe:cat {}/{{}}-{{{{000000..{{}}}}}}.tar".format(digits_shards)
    dc = DataConfig(dataset="shards", train_shards=pattern.format("train", "000004"),
                    val_shards=pattern.format("val", "000001"))
    with pytest.raises(DataError, match="pipe: command: name the shard index with --data.shard_index"):
        build_datasets(dc)
    dc.shard_index = str(digits_shards / "index.json")
    train, val, info = build_datasets(dc)
    assert info.num_train == 1438 and train.urls[0] == f"pipe:cat {digits_shards}/train-000000.tar"
    labels = torch.cat([labels for _, labels in build_loaders(train, val, LoaderSpec(64, 0), 0, 1)[1]])
    assert len(labels) == 359


def test_a_cut_shard_is_named(digits_shards, tmp_path):
    for name in ("train-000000.tar", "train-000001.tar", "train-000002.tar", "train-000003.tar",
                 "train-000004.tar", "val-000000.tar", "val-000001.tar", "index.json"):
        (tmp_path / name).write_bytes((digits_shards / name).read_bytes())
    cut = tmp_path / "val-000001.tar"
    cut.write_bytes(cut.read_bytes()[:5000])
    _, val, _ = sets(tmp_path)
    with pytest.raises(BadSampleError, match="shard .*val-000001.tar: "):
        [batch for batch in build_loaders(val, val, LoaderSpec(32, 0), 0, 1)[1]]


@pytest.mark.distributed
def test_shards_over_http_train_2_ranks_as_well_as_the_image_folder_they_were_written_from(tmp_path, http_server):
    www, url = http_server
    write_image_folder(tmp_path / "photos", per_class=24, size=16)  # 72 images, 14 held out (20%, rounded down)
    shard(www, "--from", "imagefolder", "--data-dir", tmp_path / "photos", "--shard-size", "8", "--image-size", "16")
    common = ["--image-size", "16", "--epochs", "4", "--batch-size", "4", "--lr", "0.05"]
    launch("mpirun", 2, TRAIN, "--output-dir", tmp_path / "folder", "--dataset", "imagefolder", "--data-dir",
           tmp_path / "photos", *common, *QUIET)
    launch("horovodrun-gloo", 2, TRAIN, "--output-dir", tmp_path / "shards", "--dataset", "shards",
           "--data.train_shards", f"{url}/train-{{000000..000007}}.tar", "--data.val_shards",
           f"{url}/val-{{000000..000001}}.tar", "--workers", "1", *common, *QUIET)
    folder, shards = read_json(tmp_path / "folder" / "summary.json"), read_json(tmp_path / "shards" / "summary.json")
    assert shards["params_in_sync"] and shards["world_size"] == 2
    assert [h["val_count"] for h in shards["history"]] == [h["val_count"] for h in folder["history"]] == [14] * 4
    # Same images, same model, a different order: the same accuracy within noise (the tints are easy to learn).
    assert folder["best_val_acc1"] >= 80 and shards["best_val_acc1"] >= 80, (folder["history"], shards["history"])


@pytest.mark.distributed
def test_a_missing_shard_on_the_server_is_named_in_one_line(tmp_path, http_server):
    www, url = http_server
    shard(www, "--from", "digits", "--shard-size", "300")
    (www / "train-000003.tar").unlink()
    proc = run_app("mpirun", 2, "--output-dir", tmp_path / "out", *shard_flags(url), check=False)
    assert proc.returncode != 0
    lines = [line for line in (proc.stdout + proc.stderr).splitlines() if "train-000003.tar" in line]
    assert len(lines) == 1 and "cannot read it" in lines[0] and "hvd-train shard" in lines[0], proc.stderr[-3000:]


@pytest.mark.distributed
def test_a_job_killed_within_an_epoch_of_shards_resumes_to_the_weights_of_one_never_stopped(tmp_path, digits_shards):
    # 2 ranks of 2 loader workers each; the plan gives every rank 16 steps in epoch 1 and 18 in epoch 2. A checkpoint
    # every 8 steps of the run: step 24 is epoch 2's 8th, and the job dies (SIGKILL, every rank) right after it is
    # written. The resumed
    # run's workers skip the batches done without decoding them, and the shuffle buffers and transforms go on as in
    # the run that never stopped.
    common = [*shard_flags(digits_shards), "--workers", "2", "--epochs", "2", "--checkpoint.every_steps", "8", *QUIET]
    launch("horovodrun-gloo", 2, TRAIN, "--output-dir", tmp_path / "straight", *common)
    killed = launch("horovodrun-gloo", 2, WORKERS / "killed_after_save.py", "24", "--", "--output-dir",
                    tmp_path / "resumed", *common, check=False)
    assert killed.returncode != 0
    partial = torch.load(tmp_path / "resumed" / "checkpoints" / "last.pt", weights_only=True)["partial"]
    assert (partial["epoch"], partial["steps"]) == (2, 8), partial
    proc = launch("horovodrun-gloo", 2, TRAIN, "--output-dir", tmp_path / "resumed", "--resume", "auto", *common)
    assert "resumed within epoch 2: epoch 2 continues after its step 8, as the shards' plan was" in proc.stdout
    straight = torch.load(tmp_path / "straight" / "checkpoints" / "last.pt", weights_only=True)
    resumed = torch.load(tmp_path / "resumed" / "checkpoints" / "last.pt", weights_only=True)
    for name, value in straight["model"].items():
        assert torch.equal(value, resumed["model"][name]), f"{name} differs after resuming"
    history = [read_json(tmp_path / run / "summary.json")["history"] for run in ("straight", "resumed")]
    assert [h["train_loss"] for h in history[0]] == [h["train_loss"] for h in history[1]]
    assert [h["train_count"] for h in history[0]] == [h["train_count"] for h in history[1]]
    assert all(h["val_count"] == 359 for h in history[0] + history[1])


def test_a_run_refused_for_its_shards_says_so_once(tmp_path, app, digits_shards):
    assert_refused(app("--output-dir", tmp_path / "out", *shard_flags(digits_shards), "--batch-size", "1500"),
                   "a step takes 1500 samples per rank")
    assert not (tmp_path / "out").exists()


@pytest.mark.distributed
def test_an_elastic_reset_reads_the_epoch_again_whole_for_the_workers_left(tmp_path, digits_shards):
    out = tmp_path / "run"
    elastic_run_losing_a_worker(tmp_path, "--output-dir", out, *shard_flags(digits_shards), "--batch-size", "16")
    summary = read_json(out / "summary.json")
    assert [h["epoch"] for h in summary["history"]] == [1, 2, 3] and summary["world_size"] == 1
    assert all(h["val_count"] == 359 for h in summary["history"])  # validation whole, before and after the reset
    # The reset rolled back to the start of epoch 2, which was then read whole by the survivor: its training
    # count is the whole epoch as planned for one worker, not the remainder of a two-worker epoch.
    train = sets(digits_shards)[0]
    for h in summary["history"][1:]:
        assert h["train_count"] == train_plan(train, h["epoch"], 0, 1, 0, 16)[1] * 16, summary["history"]
    assert summary["elastic"]["resets"] >= 1
