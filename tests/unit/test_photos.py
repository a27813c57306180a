"""Photos as uint8 (data/images.py) and the feed that normalizes them on the device (hvd_train/trainer.py): the loader
workers' crop and the device's batch crop agree for the same draws, validation never draws, JPEG draft mode covers
the crop it would cover at full size, and shards written with --max-side hold bounded images."""
import io
import json

import pytest
import torch
from PIL import Image

from formats import DRAFT_MEAN_LEVELS, MEAN_LEVELS, P99_LEVELS, both_ways, photo
from hvd_train.data import LoaderSpec, build_loaders
from hvd_train.data.augment import seed_all
from hvd_train.data.images import MEAN, STD
from hvd_train.data.images import PhotoTransform, decode, header, val_crop
from hvd_train.data import build_datasets
from hvd_train.config import DataConfig
from hvd_train.trainer import AHEAD, Feed


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """An image folder of 2 classes: JPEGs of ImageNet's usual size, a large one, and a PNG among them."""
    root = tmp_path_factory.mktemp("photos")
    for i in range(12):
        d = root / f"class{i % 2}"
        d.mkdir(exist_ok=True)
        (d / f"{i:03d}.jpg").write_bytes(photo(500, 375, i) if i != 5 else photo(375, 500, i))
    (root / "class0" / "big.jpg").write_bytes(photo(2000, 1500, 3))
    Image.open(io.BytesIO(photo(400, 300, 7))).save(root / "class1" / "flat.png")
    return root


def files(folder):
    return sorted(str(p) for p in folder.glob("*/*.*"))


@pytest.mark.parametrize("train", [True, False], ids=["training", "validation"])
def test_the_workers_crop_and_the_devices_batch_crop_agree_for_the_same_draws(folder, train):
    # Every file but the large one, which the workers decode in draft mode (the next test); at 224 px no crop of
    # a 500 x 375 photo is twice the output, so none is drafted.
    paths = [p for p in files(folder) if not p.endswith("big.jpg")]
    cpu, device = both_ways(paths, train)
    assert cpu.dtype == torch.uint8 and cpu.shape == device.shape == (len(paths), 3, 224, 224)
    diff = (cpu.float() - device).abs()
    assert diff.mean() < MEAN_LEVELS and diff.flatten().quantile(0.99) < P99_LEVELS, (diff.mean(), diff.max())
    # The flips and crops themselves are the same: a mirrored or shifted crop differs by tens of levels.
    mirrored = (cpu.float().flip(-1) - device).abs().mean(dim=(1, 2, 3))
    assert (diff.mean(dim=(1, 2, 3)) < mirrored).all()


def test_draft_mode_decodes_a_large_jpeg_reduced_and_keeps_what_the_crop_covers(folder):
    data = (folder / "class0" / "big.jpg").read_bytes()
    full, scale_full = decode(data, 1.0)
    reduced, scale = decode(data, 0.2)  # a crop that needs a fifth of the pixels: libjpeg scales by 1/4
    assert scale_full == 1.0 and full.shape == (3, 1500, 2000)
    assert scale == 0.25 and reduced.shape == (3, 375, 500)
    # Validation of the large photo at 64 px: drafted on the workers, whole on the device; the same region.
    cpu, device = both_ways([str(folder / "class0" / "big.jpg")] * 2, train=False, size=64)
    box = val_crop(2000, 1500, 64)
    assert box[2] - box[0] > 4 * 64  # the crop needs a quarter of the resolution: draft mode applies
    diff = (cpu.float() - device).abs()
    assert diff.mean() < DRAFT_MEAN_LEVELS, diff.mean()
    # Shifted by a sixteenth of the crop, the same photo differs by far more: the draft covers the same region.
    assert (cpu.float()[..., 4:] - device[..., :-4]).abs().mean() > 2 * diff.mean()


def test_validation_never_draws(folder):
    path = files(folder)[0]
    crops = []
    for seed in (0, 1, 2):
        seed_all(seed)
        crops.append(PhotoTransform(64, train=False)(path))
    assert all(torch.equal(crops[0], c) for c in crops[1:])
    seed_all(0)
    first = PhotoTransform(64, train=True)(path)
    seed_all(1)
    assert not torch.equal(first, PhotoTransform(64, train=True)(path))


def test_a_broken_photo_is_named_on_either_side(folder, tmp_path):
    bad = tmp_path / "cut.jpg"
    bad.write_bytes((folder / "class0" / "000.jpg").read_bytes()[:300])
    from hvd_train.errors import BadSampleError

    with pytest.raises(BadSampleError, match="cut.jpg: cannot read this image"):
        PhotoTransform(64, True)(str(bad))


def loader_batches(dc, decode_where, workers=1, steps=3):
    """The first `steps` training batches and the first validation batch of the data set, through build_loaders and
    the feed on the CPU (a GPU only changes where the device's half runs)."""
    train, val, info = build_datasets(dc)
    spec = LoaderSpec(batch_size=4, seed=3, workers=workers, decode=decode_where, image_size=32)
    train_loader, val_loader, sampler = build_loaders(train, val, spec, rank=0, world_size=1)
    sampler.set_epoch(1)
    feed = Feed(torch.device("cpu"), info.preprocessing.mean, info.preprocessing.std)
    got = [images for images, _ in list(feed.batches(train_loader, epoch=1))[:steps]]
    return got, next(iter(feed.batches(val_loader)))[0]


@pytest.mark.parametrize("source", ["folder", "shards"])
def test_loaders_hand_uint8_or_encoded_photos_and_the_feed_makes_the_same_batches_of_both(
        folder, tmp_path, tool, source):
    dc = DataConfig(dataset="imagefolder", data_dir=str(folder), image_size=32, val_fraction=0.25)
    if source == "shards":
        proc = tool("shard", "--from", "imagefolder", "--data-dir", folder, "--out", tmp_path / "s", "--shard-size",
                    "5", "--val-fraction", "0.25")
        assert proc.returncode == 0, proc.stderr
        dc = DataConfig(dataset="shards", image_size=32, train_shards=f"{tmp_path}/s/train-{{000000..000001}}.tar",
                        val_shards=f"{tmp_path}/s/val-{{000000..000000}}.tar")
    train, val, _ = build_datasets(dc)
    train_loader, _, sampler = build_loaders(train, val, LoaderSpec(batch_size=4, seed=3, image_size=32), rank=0,
                                             world_size=1)
    sampler.set_epoch(1)
    images, labels = next(iter(train_loader))
    assert images.dtype == torch.uint8 and images.shape == (4, 3, 32, 32)  # a quarter of float32's bytes
    on_cpu, val_cpu = loader_batches(dc, "cpu")
    on_device, val_device = loader_batches(dc, "gpu")
    for a, b in zip(on_cpu + [val_cpu], on_device + [val_device]):
        assert a.dtype == b.dtype == torch.float32 and a.shape == b.shape
        # At 32 px the workers draft most crops. Normalized by ImageNet's std (about 0.225), a level of 255 is
        # 1 / (255 * 0.225) = 0.017.
        assert (a - b).abs().mean() < DRAFT_MEAN_LEVELS * 0.018
    # Normalized as the preprocessing record says: the feed's mean and std of ImageNet.
    assert -2.2 < float(on_cpu[0].min()) and float(on_cpu[0].max()) < 2.7


def test_the_feed_normalizes_uint8_and_erases_by_epoch_and_step():
    from timm.data.random_erasing import RandomErasing

    images = torch.randint(0, 256, (4, 3, 8, 8), dtype=torch.uint8)
    plain = Feed(torch.device("cpu"), MEAN, STD)
    out, _ = plain((images, torch.zeros(4)))
    expected = (images.float() / 255 - torch.tensor(MEAN).view(1, 3, 1, 1)) / torch.tensor(STD).view(1, 3, 1, 1)
    torch.testing.assert_close(out, expected)
    erasing = Feed(torch.device("cpu"), MEAN, STD, RandomErasing(1.0, mode="pixel", device="cpu"), seed=5, rank=1)
    first = erasing((images, torch.zeros(4)), key=(2, 7))[0]
    assert not torch.equal(first, out)  # erased
    assert torch.equal(first, erasing((images, torch.zeros(4)), key=(2, 7))[0])  # a resumed step erases the same
    assert not torch.equal(first, erasing((images, torch.zeros(4)), key=(2, 8))[0])
    floats = torch.rand(2, 3, 8, 8)
    assert torch.equal(erasing((floats, torch.zeros(2)), key=(1, 1))[0], floats)  # floats are the data set's own


def encoded_batches(folder, count, fail_after=None, taken=None):
    """`count` batches of 2 encoded photos (as the loader hands them for --data.decode gpu); an error instead of
    batch `fail_after`; `taken` counts the batches drawn."""
    from hvd_train.data.images import collate_encoded

    transform = PhotoTransform(32, train=True).on_device()
    paths = [p for p in files(folder) if p.endswith(".jpg")]
    for i in range(count):
        if i == fail_after:
            raise ValueError(f"batch {i} does not load")
        if taken is not None:
            taken.append(i)
        seed_all(i)
        yield collate_encoded([(transform(paths[(2 * i + j) % len(paths)]), j) for j in range(2)])


def test_a_batch_of_encoded_photos_travels_as_a_few_tensors_whatever_its_size(folder):
    # A loader worker hands each tensor of a batch over in a shared-memory segment of its own: the JPEGs' bytes go
    # as one flat tensor, so a batch costs the training process the same few mappings at 2 photos or 128.
    from hvd_train.data.images import collate_encoded

    transform = PhotoTransform(32, train=True).on_device()
    paths = files(folder)  # JPEGs and a PNG, which the worker decodes
    samples = [(transform(p), i) for i, p in enumerate(paths)]
    batch, _ = collate_encoded(samples)
    tensors = [v for v in vars(batch).values() if torch.is_tensor(v)] + list(batch.decoded.values())
    assert len(tensors) == 5 and len(batch) == len(paths)  # bytes, lengths, boxes, flips; the PNG's pixels
    for path, sample, image in zip(paths, samples, batch.images):
        if path.endswith(".png"):
            assert image.dim() == 3 and torch.equal(image, sample[0].image)
        else:
            assert image.dim() == 1 and image.is_contiguous() and bytes(image.numpy()) == open(path, "rb").read()


def test_encoded_photos_are_prepared_on_a_thread_in_order_erased_by_step_and_its_errors_reach_the_step(folder):
    import threading

    from timm.data.random_erasing import RandomErasing

    def feed():
        return Feed(torch.device("cpu"), MEAN, STD, RandomErasing(1.0, mode="pixel", device="cpu"), seed=5)

    # In the loader's order, each erased by its own (epoch, step): the same as preparing them one by one here.
    ahead = [images for images, _ in feed().batches(encoded_batches(folder, 5), epoch=2, first_step=3)]
    one_by_one = feed()
    alone = [one_by_one(batch, key=(2, step))[0] for step, batch in enumerate(encoded_batches(folder, 5), 3)]
    assert len(ahead) == 5 and all(torch.equal(a, b) for a, b in zip(ahead, alone))
    # A batch that does not load stops the step that would take it, with its own error, after those before it.
    got = []
    with pytest.raises(ValueError, match="batch 3 does not load"):
        for images, _ in feed().batches(encoded_batches(folder, 6, fail_after=3), epoch=1):
            got.append(images)
    assert len(got) == 3
    # Left after one batch (a step limit, a stop): the thread ends, having drawn at most the batches it may hold.
    taken = []
    batches = feed().batches(encoded_batches(folder, 50, taken=taken), epoch=1)
    next(batches)
    batches.close()
    assert not [t for t in threading.enumerate() if t.name == "hvd-train-decode"]
    assert len(taken) <= AHEAD + 1, taken


def test_shards_with_max_side_hold_bounded_photos_and_record_it(folder, tmp_path, tool):
    out = tmp_path / "shards"
    proc = tool("shard", "--from", "imagefolder", "--data-dir", folder, "--out", out, "--shard-size", "8",
                "--max-side", "400")
    assert proc.returncode == 0, proc.stderr
    index = json.loads((out / "index.json").read_text())
    assert index["facts"]["max_side"] == 400
    import tarfile

    sides, untouched = [], 0
    originals = {p.read_bytes() for p in folder.glob("*/*.*")}
    for shard in sorted(out.glob("*.tar")):
        with tarfile.open(shard) as tar:
            for member in tar.getmembers():
                if member.name.endswith((".jpg", ".png")):
                    data = tar.extractfile(member).read()
                    width, height, _ = header(data)
                    sides.append(max(width, height))
                    untouched += data in originals
    assert len(sides) == 14 and max(sides) == 400
    assert untouched == 1  # the PNG of 400 x 300 went as it was; every larger photo was resized


def test_max_side_out_of_range_is_refused(folder, tmp_path, tool):
    proc = tool("shard", "--from", "imagefolder", "--data-dir", folder, "--out", tmp_path / "s", "--max-side", "-1")
    assert proc.returncode == 2 and "--max-side -1" in proc.stderr and not (tmp_path / "s").exists()


def test_where_photos_are_decoded_follows_the_setting_the_device_and_the_workers():
    from hvd_train.training import decode_place
    from hvd_train.config import parse_config
    from hvd_train.errors import ConfigError

    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")  # a device named, never used: no GPU needed
    assert decode_place(parse_config([]), cpu) == "cpu"
    assert decode_place(parse_config(["--workers", "2"]), cuda) == "auto"  # too few workers: the GPU decodes
    assert decode_place(parse_config(["--workers", "8"]), cuda) == "cpu"  # enough workers: they decode
    assert decode_place(parse_config(["--workers", "2", "--aa", "rand-m9-mstd0.5"]), cuda) == "cpu"
    assert decode_place(parse_config(["--workers", "8", "--data.decode", "gpu"]), cuda) == "gpu"
    with pytest.raises(ConfigError, match="--color-jitter is a policy on PIL images"):
        decode_place(parse_config(["--data.decode", "gpu", "--color-jitter", "0.4"]), cuda)
