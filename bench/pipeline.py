"""The input pipeline: how many images a second the loaders make, and whether a GPU's step gets them.

    python bench/pipeline.py photos DIR --count 4000        # ImageNet-like JPEGs (500 x 375, about 80 KB)
    python bench/pipeline.py loader --data-dir DIR --path torchvision|app [--decode cpu|gpu] [--workers 1]
           [--batch-size 64] [--image-size 224] [--batches 20] --out rate.json
    python bench/pipeline.py arrays --path torchvision|before|app --out rate.json    # CIFAR-shaped arrays, 32 px

`loader` times one rank's training loader and what the feed does to its batches (hvd_train/trainer.py) on this
machine's device, nothing else: torchvision's ImageFolder with its default training transforms (PIL decode,
RandomResizedCrop, flip, ToTensor, Normalize: the peer, and what the app did before photos went as uint8), or the
app's (--data.decode cpu: uint8 crops from the workers; gpu: bytes from the workers, nvjpeg and the crop on the
GPU). With --workers 1 the rate is one core's. bench/run.py's pipeline section and scripts/gpu_check.sh run it.
"""
import argparse
import functools
import json
import os
import sys
import time

from common import ROOT  # noqa: F401  (puts the app on the path)


def write_photos(root, count, seed=0):
    """`count` JPEGs of ImageNet's usual shape and size, in 10 class folders: cut at random from scikit-learn's two
    bundled photographs, scaled, mirrored, recoloured, with a camera's grain (about 80 KB each; ImageNet's average
    about 110 KB), saved at quality 85-95; written by every core."""
    import multiprocessing

    with multiprocessing.Pool(os.cpu_count() or 1) as pool:
        pool.map(functools.partial(write_photo, root, seed), range(count), chunksize=16)


@functools.lru_cache(maxsize=None)
def source_photo(name):
    """One of scikit-learn's bundled photographs, decoded once a process (it costs as much as a photo written)."""
    from PIL import Image
    from sklearn.datasets import load_sample_image

    return Image.fromarray(load_sample_image(name))


def write_photo(root, seed, i):
    import numpy as np
    from PIL import Image, ImageEnhance

    rng = np.random.default_rng([seed, i])
    source = source_photo(("china.jpg", "flower.jpg")[i % 2])
    path = os.path.join(root, f"class{i % 10}", f"{i:06d}.jpg")
    width, height = (500, 375) if rng.random() < 0.75 else (375, 500)
    scale = rng.uniform(max(width / source.width, height / source.height), 1.6)
    big = source.resize((int(source.width * scale) + 1, int(source.height * scale) + 1), Image.BILINEAR)
    left, top = int(rng.integers(0, big.width - width + 1)), int(rng.integers(0, big.height - height + 1))
    image = big.crop((left, top, left + width, top + height))
    if rng.random() < 0.5:
        image = image.transpose(Image.FLIP_LEFT_RIGHT)
    image = ImageEnhance.Color(image).enhance(rng.uniform(0.6, 1.4))
    grain = rng.standard_normal((height, width, 3), dtype=np.float32) * 10
    pixels = (np.asarray(image).astype(np.float32) + grain).clip(0, 255).astype(np.uint8)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    Image.fromarray(pixels).save(path, quality=int(rng.integers(85, 96)))


def torchvision_loader(data_dir, size, batch, workers):
    """torchvision's ImageFolder with its default training transforms: what the peer (and the app before) ran."""
    import torch
    from torchvision import datasets, transforms as T

    transform = T.Compose([T.RandomResizedCrop(size), T.RandomHorizontalFlip(), T.ToTensor(),
                           T.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))])
    dataset = datasets.ImageFolder(data_dir, transform=transform)
    return torch.utils.data.DataLoader(dataset, batch_size=batch, shuffle=True, num_workers=workers,
                                       persistent_workers=workers > 0, drop_last=True), None


def app_loader(data_dir, size, batch, workers, decode, device):
    """The app's training loader of the folder, and the feed that finishes its batches on `device`."""
    from hvd_train.config import DataConfig
    from hvd_train.data import LoaderSpec, build_loaders
    from hvd_train.data.augment import Augmentation
    from hvd_train.data import build_datasets
    from hvd_train.trainer import Feed

    # The run's default augmentation (RandomResizedCrop and flip), as a training run passes it
    train, val, info = build_datasets(DataConfig(dataset="imagefolder", data_dir=data_dir, image_size=size), 0,
                                      Augmentation())
    spec = LoaderSpec(batch, 0, workers, pin_memory=device.type == "cuda", decode=decode, drop_last=True)
    loader, _, sampler = build_loaders(train, val, spec, rank=0, world_size=1)
    sampler.set_epoch(1)
    return loader, Feed(device, info.preprocessing.mean, info.preprocessing.std)


def arrays_loader(path, batch):
    """CIFAR-shaped data (10,000 uint8 images of 32 x 32) with CIFAR's augmentation: torchvision's way (PIL crop
    and flip, ToTensor, Normalize), the app's before (a float tensor per sample, crop, flip, normalized in the data
    set) or the app's now (uint8 through the crop and flip, normalized by the feed). No workers: the training
    process loads arrays."""
    import torch

    from hvd_train.data.arrays import ImageTensorDataset
    from hvd_train.data.augment import Augmentation, SeededBatches, SeededSamples
    from hvd_train.trainer import Feed

    mean, std = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)
    images = torch.randint(0, 256, (10000, 3, 32, 32), dtype=torch.uint8)
    labels = torch.randint(0, 10, (10000,))
    if path == "torchvision":
        from torchvision import transforms as T

        transform = T.Compose([T.ToPILImage(), T.RandomCrop(32, padding=4), T.RandomHorizontalFlip(), T.ToTensor(),
                               T.Normalize(mean, std)])
        dataset = [(images[i], int(labels[i])) for i in range(len(labels))]

        class Set(torch.utils.data.Dataset):
            def __len__(self):
                return len(dataset)

            def __getitem__(self, i):
                return transform(dataset[i][0]), dataset[i][1]

        return torch.utils.data.DataLoader(Set(), batch_size=batch, shuffle=True, drop_last=True), None
    data = ImageTensorDataset(images, labels, mean=mean, std=std).augmented(Augmentation(), "natural")
    feed = Feed(torch.device("cpu"), mean, std)
    if path == "before":  # what the app did before: floats from the start, normalized in the data set
        data, feed = FloatArrays(data), None
    sampler = torch.utils.data.RandomSampler(data)
    loader = torch.utils.data.DataLoader(SeededSamples(data), batch_sampler=SeededBatches(sampler, batch, 0, True))
    return loader, feed


class FloatArrays:
    """The app's arrays as it read them before they went as uint8: each sample made float in [0, 1], augmented as
    floats and normalized in the data set."""

    def __init__(self, arrays):
        self.arrays = arrays

    def __len__(self):
        return len(self.arrays)

    def __getitem__(self, index):
        image = self.arrays.augment(self.arrays.images[index].float() / 255.0)
        return (image - self.arrays.mean) / self.arrays.std, self.arrays.labels[index]


def rate(loader, feed, warmup, batches):
    """Images a second over `batches` batches after `warmup` (workers start, files come into the page cache)."""
    import torch

    seen, start, images = 0, None, 0
    while True:
        for batch in loader:
            if feed is not None:
                batch = feed(batch)
            seen += 1
            if seen == warmup:
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
                start = time.perf_counter()
            elif seen > warmup:
                images += len(batch[1])
            if seen == warmup + batches:
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
                return images / (time.perf_counter() - start)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="what", required=True)
    make = sub.add_parser("photos")
    make.add_argument("root")
    make.add_argument("--count", type=int, default=4000)
    for name in ("loader", "arrays"):
        q = sub.add_parser(name)
        q.add_argument("--path", choices=("torchvision", "app") + (("before",) if name == "arrays" else ()),
                       required=True)
        q.add_argument("--batch-size", type=int, default=64)
        q.add_argument("--warmup", type=int, default=3)
        q.add_argument("--batches", type=int, default=20)
        q.add_argument("--out", required=True)
        if name == "loader":
            q.add_argument("--data-dir", required=True)
            q.add_argument("--decode", choices=("cpu", "gpu"), default="cpu")
            q.add_argument("--workers", type=int, default=1)
            q.add_argument("--image-size", type=int, default=224)
    args = p.parse_args()
    if args.what == "photos":
        write_photos(args.root, args.count)
        return 0
    import torch

    torch.set_num_threads(1)  # one core's work: the training process only hands batches on
    if args.what == "arrays":
        loader, feed = arrays_loader(args.path, args.batch_size)
        record = {"path": args.path}
    else:
        device = torch.device("cuda" if args.decode == "gpu" or torch.cuda.is_available() else "cpu")
        if args.path == "torchvision":
            loader, feed = torchvision_loader(args.data_dir, args.image_size, args.batch_size, args.workers)
            if device.type == "cuda":
                from hvd_train.trainer import Feed

                feed = Feed(device)  # the float batch to the GPU, as a training step would take it
        else:
            loader, feed = app_loader(args.data_dir, args.image_size, args.batch_size, args.workers, args.decode,
                                      device)
        record = {"path": args.path, "decode": args.decode, "workers": args.workers, "device": str(device)}
    record["img_per_sec"] = rate(loader, feed, args.warmup, args.batches)
    with open(args.out, "w") as f:
        json.dump(record, f)
    print(json.dumps(record))
    return 0


if __name__ == "__main__":
    sys.exit(main())
