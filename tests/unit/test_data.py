import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from torch.utils.data import TensorDataset

from hvd_train.config import DataConfig
from hvd_train.data import build_datasets
from hvd_train.trainer import Feed, image_figures
from hvd_train.data import DataError, LoaderSpec, build_loaders
from hvd_train.data.catalog import load_digits_dataset, read_digits
from hvd_train.data.samplers import ShardSampler
from hvd_train.data.samplers import split_indices
from conftest import ROOT
from formats import (write_cifar10, write_cifar100_binary, write_cifar_python, write_desktop_litter,
                     write_image_folder, write_mnist, write_stl10)


def test_digits_are_the_1797_bundled_8x8_images_scaled_to_unit_range():
    digits = load_digits_dataset()
    images = torch.stack([digits[i][0] for i in range(len(digits))])
    labels = torch.stack([digits[i][1] for i in range(len(digits))])
    assert images.shape == (1797, 1, 8, 8) and labels.shape == (1797,)
    assert images.min() >= 0.0 and images.max() <= 1.0
    assert set(labels.tolist()) == set(range(10))


def test_digits_read_from_the_package_file_are_scikit_learns_digits_without_importing_it():
    from sklearn.datasets import load_digits  # the reference; the app's read must not need it
    images, labels = read_digits()
    bunch = load_digits()
    assert np.array_equal(images, bunch.images) and np.array_equal(labels, bunch.target)
    code = "import sys; from data.catalog import read_digits; read_digits(); print('sklearn' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_split_is_deterministic_disjoint_and_complete():
    train, val = split_indices(1797, 0.2, seed=0)
    assert (train, val) == split_indices(1797, 0.2, seed=0)
    assert set(train).isdisjoint(val) and sorted(train + val) == list(range(1797))
    assert len(val) == round(1797 * 0.2)
    assert split_indices(1797, 0.2, seed=1)[1] != val


@pytest.mark.parametrize("n,fraction", [(2, 0.01), (2, 0.99), (10, 0.5)])
def test_split_keeps_at_least_one_sample_on_each_side(n, fraction):
    train, val = split_indices(n, fraction, seed=0)
    assert train and val


def test_split_refuses_a_single_sample():
    with pytest.raises(ValueError, match="cannot split 1 sample"):
        split_indices(1, 0.2, seed=0)


@pytest.mark.parametrize("n,world", [(7, 2), (359, 2), (3, 4), (8, 8), (0, 2)])
def test_shard_sampler_gives_every_sample_to_exactly_one_rank(n, world):
    seen = [i for rank in range(world) for i in ShardSampler(n, rank, world)]
    assert sorted(seen) == list(range(n))


def test_shard_sampler_rejects_a_rank_outside_the_world():
    with pytest.raises(ValueError, match="rank 2"):
        ShardSampler(10, 2, 2)


def test_training_shards_are_disjoint_and_reshuffled_each_epoch():
    dataset = TensorDataset(torch.arange(100).float().unsqueeze(1), torch.zeros(100, dtype=torch.long))
    shards = []
    for rank in range(2):
        loader, _, sampler = build_loaders(dataset, dataset, LoaderSpec(10, seed=3), rank, 2)
        sampler.set_epoch(1)
        epoch1 = torch.cat([x for x, _ in loader]).flatten().tolist()
        sampler.set_epoch(2)
        epoch2 = torch.cat([x for x, _ in loader]).flatten().tolist()
        assert epoch1 != epoch2
        shards.append(epoch1)
    assert set(shards[0]).isdisjoint(shards[1]) and len(shards[0]) == len(shards[1]) == 50


def test_each_ranks_loader_workers_draw_from_seed_plus_rank_and_the_shuffle_from_the_shared_seed():
    # torch seeds worker w's torch, random and NumPy from a base seed drawn from the loader's generator, plus w.
    dataset = TensorDataset(torch.arange(20).float().unsqueeze(1), torch.zeros(20, dtype=torch.long))
    before = torch.get_rng_state()
    for rank in range(2):
        train_loader, val_loader, sampler = build_loaders(dataset, dataset, LoaderSpec(4, seed=3, workers=1), rank, 2)
        assert train_loader.generator.initial_seed() == val_loader.generator.initial_seed() == 3 + rank
        assert sampler.seed == train_loader.batch_sampler.seed == 3
    assert torch.equal(torch.get_rng_state(), before)  # the training process's own stream (dropout) untouched


def test_the_last_incomplete_training_batch_is_dropped_unless_asked_to_keep_it():
    # 25 samples on 2 ranks: 13 each (the sampler pads), 3 batches of 4 and one of 1 that a step would take alone.
    dataset = TensorDataset(torch.arange(25).float().unsqueeze(1), torch.zeros(25, dtype=torch.long))
    for drop_last, sizes in ((True, [4, 4, 4]), (False, [4, 4, 4, 1])):
        for rank in range(2):
            loader, val_loader, sampler = build_loaders(dataset, dataset, LoaderSpec(4, seed=3, drop_last=drop_last),
                                                        rank, 2)
            sampler.set_epoch(1)
            assert [len(x) for x, _ in loader] == sizes and len(loader) == len(sizes)
            assert sum(len(x) for x, _ in val_loader) in (12, 13)  # validation: every sample, once over the ranks


def test_loader_workers_use_a_fork_safe_start_method():
    dataset = TensorDataset(torch.arange(8).float(), torch.zeros(8, dtype=torch.long))
    loader, _, _ = build_loaders(dataset, dataset, LoaderSpec(4, seed=0, workers=1), 0, 1)
    assert loader.multiprocessing_context.get_start_method() == "forkserver"
    assert sorted(torch.cat([x for x, _ in loader]).tolist()) == list(range(8))


def test_loader_workers_fork_from_a_server_that_imported_torch_and_horovod_once(tmp_path):
    # Python 3.11's fork server never preloads the main script, so each worker imported torch, Horovod and the app
    # itself (seconds of CPU a worker). A main script that imports them, as train_hvd.py does: the server holds
    # libtorch and Horovod's extension, and the worker is its child.
    script = tmp_path / "main.py"
    script.write_text(
        "import psutil, torch\n"
        "import hvd_utils\n"
        "from torch.utils.data import TensorDataset\n"
        "from hvd_train.data import LoaderSpec, build_loaders\n"
        "if __name__ == '__main__':\n"
        "    data = TensorDataset(torch.arange(8).float(), torch.zeros(8, dtype=torch.long))\n"
        "    loader, _, _ = build_loaders(data, data, LoaderSpec(4, seed=0, workers=1), 0, 1)\n"
        "    batches = iter(loader)\n"
        "    next(batches)\n"
        "    server, = [p for p in psutil.Process().children() if 'forkserver' in ' '.join(p.cmdline())]\n"
        "    maps = open(f'/proc/{server.pid}/maps').read()\n"
        "    print('libtorch_cpu' in maps, 'mpi_lib_v2' in maps, len(server.children()))\n")
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["True", "True", "1"], proc.stdout


# What a loader worker's resource sharer meets when its training process stops mid-hand-over of a batch: a reader
# that connects for a batch's file descriptors and goes away before the handshake ends.
_CUT_HAND_OVER = """
import os, socket, sys
from multiprocessing import resource_sharer
if sys.argv[1] == "worker":
    import torch
    from torch.utils.data import TensorDataset
    from hvd_train.data import LoaderSpec, build_loaders
    data = TensorDataset(torch.arange(8).float(), torch.zeros(8, dtype=torch.long))
    loader, _, _ = build_loaders(data, data, LoaderSpec(4, seed=0, workers=1), 0, 1)
    loader.worker_init_fn(0)
read_end, _ = os.pipe()
resource_sharer.DupFd(read_end)
reader = socket.socket(socket.AF_UNIX)
reader.connect(resource_sharer._resource_sharer._address)
reader.close()
resource_sharer.stop()  # served after the cut request: when it returns, the sharer has met the cut
try:
    raise ConnectionResetError("raised by the worker's own code")
except ConnectionResetError:
    sys.excepthook(*sys.exc_info())
"""


def test_a_stop_that_cuts_a_batch_s_hand_over_leaves_no_traceback_from_the_loader_worker():
    def stderr(process):
        return subprocess.run([sys.executable, "-c", _CUT_HAND_OVER, process], cwd=ROOT, capture_output=True,
                              text=True, timeout=300, check=True).stderr

    plain, worker = stderr("plain"), stderr("worker")
    assert "resource_sharer.py" in plain and "raised by the worker's own code" in plain, plain  # what is met
    assert "resource_sharer.py" not in worker, worker
    assert "raised by the worker's own code" in worker, worker  # anything else still reaches the hook


def test_digits_split_sizes_and_shapes():
    train, val, info = build_datasets(DataConfig())
    assert (info.in_channels, info.num_classes, info.image_size) == (1, 10, 8)
    assert len(train) == info.num_train == 1438 and len(val) == info.num_val == 359


def test_a_data_set_records_the_arguments_its_factory_was_called_with_never_as_a_fact():
    from hvd_train.data.augment import Augmentation
    from hvd_train.run.reports import describe_call

    augment = Augmentation()
    _, _, info = build_datasets(DataConfig(image_size=16), 5, augment)
    assert info.called_with == {"image_size": 16, "augment": augment}  # digits(image_size=8, augment=...)
    assert describe_call("digits", info.called_with) == "digits(image_size=16, augment=<Augmentation>)"
    assert "called_with" not in repr(info) and info == build_datasets(DataConfig(image_size=16), 6)[2]
    assert "augment" not in info.facts()


def test_image_size_resizes_samples():
    train, _, info = build_datasets(DataConfig(image_size=16))
    assert info.image_size == 16 and train[0][0].shape == (1, 16, 16)


def test_synthetic_data_has_the_asked_shape_and_is_repeatable():
    dc = DataConfig(dataset="synthetic", image_size=12, synthetic_samples=40, synthetic_channels=2,
                    synthetic_classes=5)
    train, val, info = build_datasets(dc)
    assert (len(train), len(val), info.in_channels, info.num_classes) == (40, 10, 2, 5)
    image, label = train[3]
    assert image.shape == (2, 12, 12) and 0 <= int(label) < 5
    assert torch.equal(train[3][0], image) and not torch.equal(train[4][0], image)


@pytest.mark.parametrize("dataset,folder,gz", [("mnist", "MNIST/raw", False), ("mnist", "MNIST/raw", True),
                                               ("mnist", "", True), ("fashion_mnist", "FashionMNIST/raw", True),
                                               ("fashion_mnist", "", False)])
def test_mnist_and_fashion_mnist_read_the_idx_files_gzipped_or_not_where_torchvision_or_the_authors_put_them(
        tmp_path, dataset, folder, gz):
    written = write_mnist(tmp_path, folder=folder, gz=gz)
    train, val, info = build_datasets(DataConfig(dataset=dataset, data_dir=str(tmp_path)))
    assert (len(train), len(val), info.in_channels, info.num_classes, info.image_size) == (64, 32, 1, 10, 28)
    for split, name in ((train, "train"), (val, "t10k")):
        images, labels = written[name]
        image, label = split[5]
        assert int(label) == labels[5]
        assert image.dtype == torch.uint8 and torch.equal(image[0], torch.from_numpy(images[5]))
        assert torch.allclose(fed(split[5], info)[0], torch.from_numpy(images[5]).float() / 255)


@pytest.mark.parametrize("damage,message", [(lambda b: b[:-7], "truncated"),
                                            (lambda b: b"\0\0\x0d\3" + b[4:], "not a uint8 IDX file")])
def test_a_damaged_idx_file_is_named(tmp_path, damage, message):
    write_mnist(tmp_path)
    path = tmp_path / "MNIST" / "raw" / "t10k-images-idx3-ubyte"
    path.write_bytes(damage(path.read_bytes()))
    with pytest.raises(DataError, match=f"t10k-images-idx3-ubyte: .*{message}"):
        build_datasets(DataConfig(dataset="mnist", data_dir=str(tmp_path)))


def test_a_cut_gzip_file_is_named(tmp_path):
    write_mnist(tmp_path, gz=True)
    path = tmp_path / "MNIST" / "raw" / "train-labels-idx1-ubyte.gz"
    path.write_bytes(path.read_bytes()[:-12])
    with pytest.raises(DataError, match="train-labels-idx1-ubyte.gz: cannot read it"):
        build_datasets(DataConfig(dataset="mnist", data_dir=str(tmp_path)))


def fed(sample, info):
    """A sample as the model receives it: through the run's feed, which normalizes uint8 images on the device."""
    return Feed(torch.device("cpu"), *image_figures(info))((sample[0][None], torch.zeros(1)))[0][0]


def cifar_expected(images, index, mean, std):
    return (torch.from_numpy(images[index]).float() / 255 - torch.tensor(mean).view(3, 1, 1)) / \
        torch.tensor(std).view(3, 1, 1)


@pytest.mark.parametrize("classes", [10, 100])
def test_cifar_python_version_as_torchvision_downloads_it(tmp_path, classes):
    written = write_cifar_python(tmp_path, classes=classes)
    dataset = "cifar10" if classes == 10 else "cifar100"
    train, val, info = build_datasets(DataConfig(dataset=dataset, data_dir=str(tmp_path)))
    assert (len(train), len(val), info.in_channels, info.num_classes, info.image_size) == (100, 20, 3, classes, 32)
    mean, std = (train.mean.flatten().tolist(), train.std.flatten().tolist())
    first, index = ("data_batch_2", 20 + 7) if classes == 10 else ("train", 27)
    images, labels = written[first]
    image, label = train[index]
    assert int(label) == labels[7 if classes == 10 else 27]  # CIFAR-100: the fine label
    assert image.dtype == torch.uint8
    assert torch.allclose(fed(train[index], info), cifar_expected(images, 7 if classes == 10 else 27, mean, std),
                          atol=1e-5)
    images, labels = written["test_batch" if classes == 10 else "test"]
    assert int(val[3][1]) == labels[3]
    assert torch.allclose(fed(val[3], info), cifar_expected(images, 3, mean, std), atol=1e-5)


def test_cifar100_binary_version_reads_the_fine_label(tmp_path):
    written = write_cifar100_binary(tmp_path)
    train, val, info = build_datasets(DataConfig(dataset="cifar100", data_dir=str(tmp_path)))
    assert (len(train), len(val), info.num_classes) == (100, 20, 100)
    images, fine = written["train"]
    assert [int(train[i][1]) for i in range(100)] == fine.tolist()
    mean, std = (0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)
    assert torch.allclose(fed(train[42], info), cifar_expected(images, 42, mean, std), atol=1e-5)


def test_a_cifar_pickle_that_would_run_code_is_refused_unrun(tmp_path):
    import pickle

    write_cifar_python(tmp_path)
    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    (tmp_path / "cifar-10-batches-py" / "data_batch_3").write_bytes(pickle.dumps({b"data": Payload()}))
    with pytest.raises(DataError, match="data_batch_3: not a CIFAR-10 python-version batch.*refusing"):
        build_datasets(DataConfig(dataset="cifar10", data_dir=str(tmp_path)))
    assert not marker.exists()


def test_cifar10_reads_the_binary_batches(tmp_path):
    written = write_cifar10(tmp_path)
    train, val, info = build_datasets(DataConfig(dataset="cifar10", data_dir=str(tmp_path)))
    assert (len(train), len(val), info.in_channels, info.num_classes, info.image_size) == (100, 20, 3, 10, 32)
    images, labels = written["data_batch_2"]
    image, label = train[20 + 7]  # batches are concatenated in order
    assert int(label) == labels[7]
    mean, std = torch.tensor([0.4914, 0.4822, 0.4465]), torch.tensor([0.2470, 0.2435, 0.2616])
    expected = (torch.from_numpy(images[7]).float() / 255 - mean.view(3, 1, 1)) / std.view(3, 1, 1)
    assert torch.allclose(fed(train[20 + 7], info), expected, atol=1e-5)


def test_cifar10_truncated_file_is_named(tmp_path):
    write_cifar10(tmp_path)
    path = tmp_path / "cifar-10-batches-bin" / "data_batch_3.bin"
    path.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(DataError, match="data_batch_3.bin.*not a whole number"):
        build_datasets(DataConfig(dataset="cifar10", data_dir=str(tmp_path)))


def test_stl10_reads_column_major_images_and_1_based_labels(tmp_path):
    written = write_stl10(tmp_path)
    train, val, info = build_datasets(DataConfig(dataset="stl10", data_dir=str(tmp_path), image_size=32))
    assert (len(train), len(val), info.image_size) == (12, 8, 32)
    assert train[0][0].shape == (3, 32, 32)
    native, _, native_info = build_datasets(DataConfig(dataset="stl10", data_dir=str(tmp_path)))
    images, labels = written["train"]
    image, label = native[4]
    assert int(label) == labels[4] - 1
    assert torch.equal(image, torch.from_numpy(images[4]))
    mean, std = torch.tensor([0.4467, 0.4398, 0.4066]), torch.tensor([0.2603, 0.2566, 0.2713])
    assert torch.allclose(fed(native[4], native_info) * std.view(3, 1, 1) + mean.view(3, 1, 1),
                          torch.from_numpy(images[4]).float() / 255, atol=1e-5)


def test_image_folder_with_and_without_a_val_split(tmp_path):
    write_image_folder(tmp_path / "flat")
    train, val, info = build_datasets(DataConfig(dataset="imagefolder", data_dir=str(tmp_path / "flat"),
                                                 image_size=16, val_fraction=0.5))
    assert info.num_classes == 3 and len(train) + len(val) == 18 and len(val) == 9
    assert train[0][0].shape == (3, 16, 16)
    write_image_folder(tmp_path / "tree" / "train", per_class=4)
    write_image_folder(tmp_path / "tree" / "val", per_class=2)
    train, val, info = build_datasets(DataConfig(dataset="imagefolder", data_dir=str(tmp_path / "tree"),
                                                 image_size=16))
    assert (len(train), len(val), info.num_classes) == (12, 6, 3)


def test_train_and_val_with_different_class_folders_are_refused_naming_the_classes_on_each_side(tmp_path):
    write_image_folder(tmp_path / "train", classes=("cat", "dog", "emu"), per_class=1)
    write_image_folder(tmp_path / "val", classes=("cat", "owl"), per_class=1)
    with pytest.raises(DataError) as err:
        build_datasets(DataConfig(dataset="imagefolder", data_dir=str(tmp_path), image_size=16))
    assert "train/ and val/ have different class folders: only in train/: dog, emu; only in val/: owl;" \
        in str(err.value)


@pytest.mark.parametrize("dataset,looked_for", [("mnist", "MNIST/raw"), ("cifar10", "cifar-10-batches-bin"),
                                                ("stl10", "stl10_binary"), ("imagefolder", "does not exist")])
def test_missing_data_says_where_it_looked_and_how_to_get_it(tmp_path, dataset, looked_for):
    with pytest.raises(DataError, match=looked_for) as err:
        build_datasets(DataConfig(dataset=dataset, data_dir=str(tmp_path / "nothing")))
    assert dataset == "imagefolder" or "--download" in str(err.value)


def test_missing_data_lists_what_is_there_what_is_lacking_and_every_accepted_layout(tmp_path):
    written = write_cifar_python(tmp_path)
    assert written
    (tmp_path / "cifar-10-batches-py" / "test_batch").unlink()
    (tmp_path / "README.txt").write_text("from the lab share\n")
    with pytest.raises(DataError) as err:
        build_datasets(DataConfig(dataset="cifar10", data_dir=str(tmp_path)))
    message = str(err.value)
    assert f"CIFAR-10 not found in {tmp_path}: it holds README.txt, cifar-10-batches-py/" in message
    assert "cifar-10-batches-py/ lacks test_batch" in message
    assert "cifar-10-batches-py/{data_batch_1,data_batch_2,data_batch_3,data_batch_4,data_batch_5,test_batch}" \
        in message
    assert "cifar-10-batches-bin/{data_batch_1.bin," in message and "--download" in message
    with pytest.raises(DataError, match=r"MNIST not found .*MNIST/raw/\{train-images-idx3-ubyte,.*\(.gz or not\)"):
        build_datasets(DataConfig(dataset="fashion_mnist", data_dir=str(tmp_path)))


def test_uint8_images_stay_uint8_in_memory(tmp_path):
    write_cifar10(tmp_path)
    train, _, _ = build_datasets(DataConfig(dataset="cifar10", data_dir=str(tmp_path)))
    assert train.images.dtype == torch.uint8 and isinstance(train.images, torch.Tensor)
    assert np.isfinite(train[0][0].numpy()).all()


def test_an_empty_class_folder_is_named_with_the_fix(tmp_path):
    write_image_folder(tmp_path / "tree", per_class=2, size=8)
    (tmp_path / "tree" / "emu").mkdir()
    (tmp_path / "tree" / "emu" / ".DS_Store").write_bytes(bytes(8))
    with pytest.raises(DataError, match=r"class folder\(s\) emu hold no image files .*put images in them or remove"):
        build_datasets(DataConfig(dataset="imagefolder", data_dir=str(tmp_path / "tree")))
    write_image_folder(tmp_path / "flat", classes=(".",), per_class=2, size=8)  # images, but not in class folders
    with pytest.raises(DataError, match=r"it holds 0.png, 1.png, but no class folders; ImageFolder reads"):
        build_datasets(DataConfig(dataset="imagefolder", data_dir=str(tmp_path / "flat")))


@pytest.mark.parametrize("skip_bad_files", [False, True])
def test_files_that_are_not_images_by_name_are_ignored_not_counted(tmp_path, skip_bad_files, caplog):
    write_image_folder(tmp_path, per_class=4, size=8)
    assert write_desktop_litter(tmp_path) > 0
    train, val, info = build_datasets(DataConfig(dataset="imagefolder", data_dir=str(tmp_path), image_size=8,
                                                 val_fraction=0.5, skip_bad_files=skip_bad_files))
    assert info.num_classes == 3 and len(train) + len(val) == 12  # no hidden class, no ._0.png, no notes
    assert [train.dataset.classes] == [["cat", "dog", "owl"]]
    assert [train[i] for i in range(len(train))] and "do not decode" not in caplog.text


def test_a_corrupt_image_is_named_when_read_and_left_out_when_asked(tmp_path):
    from hvd_train.data import BadSampleError

    write_image_folder(tmp_path, per_class=4, size=8)
    (tmp_path / "owl" / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n truncated")
    train, val, _ = build_datasets(DataConfig(dataset="imagefolder", data_dir=str(tmp_path), image_size=8,
                                              val_fraction=0.5))
    with pytest.raises(BadSampleError, match="broken.png: cannot read this image"):
        [train[i] for i in range(len(train))] + [val[i] for i in range(len(val))]
    train, val, _ = build_datasets(DataConfig(dataset="imagefolder", data_dir=str(tmp_path), image_size=8,
                                              val_fraction=0.5, skip_bad_files=True))
    assert len(train) + len(val) == 12
    assert [train[i] for i in range(len(train))] and [val[i] for i in range(len(val))]


def test_a_corrupt_image_met_in_a_loader_worker_keeps_its_one_line_message(tmp_path):
    from hvd_train.data import BadSampleError

    write_image_folder(tmp_path, classes=("a", "b"), per_class=2, size=8, ext="jpg")
    jpeg = tmp_path / "b" / "1.jpg"
    jpeg.write_bytes(jpeg.read_bytes()[:200])  # a JPEG cut short, as an interrupted copy leaves it
    train, val, _ = build_datasets(DataConfig(dataset="imagefolder", data_dir=str(tmp_path), image_size=8,
                                              val_fraction=0.5))
    loaders = build_loaders(train, val, LoaderSpec(batch_size=1, seed=0, workers=2), rank=0, world_size=1)
    with pytest.raises(BadSampleError) as err:
        [batch for loader in loaders[:2] for batch in loader]
    assert str(err.value).startswith(f"{jpeg}: cannot read this image") and "\n" not in str(err.value)


@pytest.mark.parametrize("world_was, world_size", [(2, 2), (2, 1), (2, 3), (3, 2)])
def test_the_rest_of_an_epoch_is_every_sample_not_yet_read_dealt_once(world_was, world_size):
    from torch.utils.data import DistributedSampler

    from hvd_train.data.samplers import rest_of_epoch

    dataset, seed, epoch, done = list(range(60)), 7, 3, 4  # 60 samples: no padding on 2 or 3 ranks before
    read = []
    for r in range(world_was):
        shard = DistributedSampler(dataset, num_replicas=world_was, rank=r, shuffle=True, seed=seed)
        shard.set_epoch(epoch)
        read.append(list(shard))
    rest = [rest_of_epoch(dataset, seed, epoch, world_was, done, r, world_size) for r in range(world_size)]
    if world_size == world_was:  # each rank goes on with its own shard, in its order
        assert rest == [shard[done:] for shard in read]
    assert len({len(share) for share in rest}) == 1  # every rank as many steps
    before, after = [i for shard in read for i in shard[:done]], [i for share in rest for i in share]
    # Every sample once over the epoch: those read before, and the rest (whose only repeats pad the shares to equal
    # length, as DistributedSampler pads).
    assert sorted(before + list(dict.fromkeys(after))) == dataset
    assert len(after) - len(set(after)) < world_size


def test_a_loader_worker_s_batches_before_a_step_follow_the_loader_s_turns():
    from hvd_train.data.shards import batches_before

    assert batches_before([3, 3], 4) == [2, 2]
    assert batches_before([3, 3], 5) == [3, 2]
    assert batches_before([1, 4], 4) == [1, 3]  # a worker that has run out is passed over
    assert batches_before([2], 2) == [2]
