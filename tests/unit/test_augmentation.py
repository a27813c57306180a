"""Augmentation and regularisation (issue 37): the default augmentation of each kind of data, timm's flags in real
2-rank runs, and what data parallelism demands of them (per-rank randomness, identical averages, bitwise resumes,
early stopping on every rank together, refusals)."""
import json

import numpy as np
import pytest
import torch

from conftest import TRAIN, assert_refused, read_json, run_app
from formats import write_cifar_python, write_mnist


def loaders(cfg_args, workers=0, rank=0, size=1):
    """The real training and validation loaders the app builds for these settings."""
    from hvd_train.training import loader_spec, prepare_data
    from hvd_train.config import parse_config
    from hvd_train.data import build_loaders

    cfg = parse_config([*map(str, cfg_args), "--workers", str(workers)])
    train_set, val_set, _ = prepare_data(cfg)
    return build_loaders(train_set, val_set, loader_spec(cfg, torch.device("cpu")), rank, size)


def epoch_samples(loader, sampler, epoch):
    """{index: image} of one epoch, read through the loader (the index from the sampler's order; the samples of
    an incomplete last batch are dropped, --data.drop_last)."""
    sampler.set_epoch(epoch)
    order = list(sampler)
    images = torch.cat([batch[0] for batch in loader])
    assert len(order) - len(images) < loader.batch_sampler.batch_size
    return {index: images[i] for i, index in enumerate(order[:len(images)])}


@pytest.mark.parametrize("dataset, write", [("cifar10", write_cifar_python), ("mnist", write_mnist)])
def test_training_samples_are_augmented_by_default_and_validation_samples_never(tmp_path, dataset, write):
    write(tmp_path)
    args = ["--dataset", dataset, "--data-dir", tmp_path, "--batch-size", 8]
    train, val, sampler = loaders(args)
    first, second = epoch_samples(train, sampler, 1), epoch_samples(train, sampler, 2)
    both = first.keys() & second.keys()  # the samples neither epoch's incomplete last batch dropped
    assert sum(not torch.equal(first[i], second[i]) for i in both) > len(both) // 2
    assert all(torch.equal(a[0], b[0]) for a, b in zip(val, val))  # validation: the same every time
    plain_train, _, plain_sampler = loaders(args + ["--no-aug"])
    plain = [epoch_samples(plain_train, plain_sampler, e) for e in (1, 2)]
    assert all(torch.equal(plain[0][i], plain[1][i]) for i in plain[0].keys() & plain[1].keys())


def test_digits_are_never_flipped_and_cifar_is(tmp_path):
    from hvd_train.data.augment import Augmentation

    aug = Augmentation()
    assert "RandomHorizontalFlip" in repr(aug.tensor_transform("natural", 32, [0.5] * 3, [0.2] * 3))
    digits = repr(aug.tensor_transform("digits", 28, [0.5], [0.2]))
    assert "RandomAffine" in digits and "Flip" not in digits


def test_augmentation_is_the_same_with_any_number_of_loader_workers(tmp_path):
    write_cifar_python(tmp_path)
    args = ["--dataset", "cifar10", "--data-dir", tmp_path, "--batch-size", 8, "--aa", "rand-m9-mstd0.5-inc1",
            "--reprob", 0.5]
    none, _, s0 = loaders(args, workers=0)
    two, _, s2 = loaders(args, workers=2)
    a, b = epoch_samples(none, s0, 3), epoch_samples(two, s2, 3)
    assert all(torch.equal(a[i], b[i]) for i in a)


def test_mixing_draws_per_rank_and_per_epoch_and_repeats_from_the_seed():
    from hvd_train.config import AugConfig
    from hvd_train.trainer import Mixing

    images, labels = torch.randn(9, 3, 8, 8), torch.arange(9) % 4
    cfg = AugConfig(mixup=0.8, cutmix=1.0)

    def mixed(rank, epoch, step, seed=42):
        return Mixing(cfg, 4, seed, rank)((images, labels), epoch, step)

    a = mixed(0, 1, 1)
    assert torch.equal(a[0], mixed(0, 1, 1)[0]) and torch.equal(a[2], mixed(0, 1, 1)[2])
    assert not torch.equal(a[0], mixed(1, 1, 1)[0])  # another rank
    assert not torch.equal(a[0], mixed(0, 2, 1)[0])  # another epoch
    assert torch.equal(a[1], labels) and a[2].shape == (9, 4)  # the odd last sample keeps its one-hot target
    assert torch.equal(a[0][8], images[8]) and a[2][8].argmax() == labels[8]
    state = np.random.get_state()[1].copy()
    mixed(0, 3, 3)
    assert np.array_equal(state, np.random.get_state()[1])  # the process's own generator is left alone
    off = Mixing(AugConfig(mixup=0.8, mixup_off_epoch=2), 4, 42, 0)((images, labels), 2, 1)
    assert torch.equal(off[0], images)


@pytest.mark.distributed
def test_every_timm_flag_trains_in_a_two_rank_run(tmp_path):
    out = tmp_path / "cnn"
    run_app("horovodrun-gloo", 2, "--output-dir", out, "--epochs", 3, "--mixup", 0.2, "--cutmix", 1.0,
            "--mixup-prob", 0.9, "--mixup-switch-prob", 0.4, "--mixup-off-epoch", 3, "--smoothing", 0.1,
            "--aa", "rand-m9-mstd0.5-inc1", "--reprob", 0.25, "--remode", "rand", "--model-ema",
            "--model-ema-decay", 0.99, "--model-ema-warmup", "--opt", "lamb", "--lr", 0.002, "--weight-decay", 0.05,
            "--sched", "cosine", "--checkpoint-hist", 2, "--patience", 5, "--batches-per-allreduce", 2,
            "--amp", "bf16", "--workers", 1)
    s = read_json(out / "summary.json")
    assert s["params_in_sync"] and s["ema_in_sync"] and len(set(s["ema_fingerprints"])) == 1
    assert "aa rand-m9" in s["augmentation"] and s["regularisation"]["mixup"] == 0.2
    assert all("val_ema_acc1" in r and r["weights"] in ("model", "ema") for r in s["history"])
    assert s["best_weights"] in ("model", "ema")
    names = {p.name for p in (out / "checkpoints").iterdir()}
    assert len([n for n in names if n.startswith("best_epoch_")]) == 2
    ckpt = torch.load(out / "checkpoints" / "last.pt", weights_only=True)
    assert int(ckpt["ema"]["updates"]) == ckpt["step"] and ckpt["model_card"]["weights"] == ckpt["weights"]

    out = tmp_path / "timm"
    run_app("horovodrun-gloo", 2, "--output-dir", out, "--epochs", 1, "--model", "timm/resnet18", "--drop-path",
            0.1, "--grad-checkpointing", "--color-jitter", 0.3, "--bce-loss", "--smoothing", 0.1, "--opt", "adamw",
            "--lr", 0.001, "--layer-decay", 0.75, "--sched", "multistep", "--optim.lr_milestones", 1)
    s = read_json(out / "summary.json")
    assert s["params_in_sync"] and "color jitter 0.3" in s["augmentation"]
    groups = torch.load(out / "checkpoints" / "last.pt", weights_only=True)["optimizer"]["param_groups"]
    assert len({g["lr_scale"] for g in groups}) > 2  # layer-wise rates


@pytest.mark.distributed
def test_patience_stops_every_rank_at_the_same_epoch(tmp_path):
    # A rate too small to change the predictions: the validation accuracy stays where it is, so it never improves.
    proc = run_app("horovodrun-gloo", 2, "--output-dir", tmp_path, "--epochs", 10, "--lr", 1e-12,
                   "--warmup-epochs", 0, "--patience", 2)
    s = read_json(tmp_path / "summary.json")
    assert s["stopped_at_epoch"] == 3 and len(s["history"]) == 3 and s["patience"] == 2
    assert "--patience 2" in proc.stdout and s["params_in_sync"]


def test_predict_and_export_use_the_average_where_it_validated_better(tmp_path, app):
    from hvd_train.tools.inference import load_trained

    assert app("--output-dir", tmp_path, "--epochs", 1, "--model-ema").returncode == 0
    path = tmp_path / "checkpoints" / "last.pt"
    ckpt = torch.load(path, weights_only=True)
    ckpt["weights"], ckpt["model_card"]["weights"] = "ema", "ema"
    torch.save(ckpt, path)
    model, card, _ = load_trained(str(path))
    assert card.weights == "ema"
    for name, value in model.state_dict().items():
        assert torch.equal(value, ckpt["ema"][f"average.module.{name}"])
    ckpt["weights"] = "model"
    torch.save(ckpt, path)
    model, _, _ = load_trained(str(path))
    assert all(torch.equal(v, ckpt["model"][k]) for k, v in model.state_dict().items())


@pytest.mark.parametrize("args, needles", [
    (["--drop-path", 0.1], ["--drop-path", "small_cnn"]),
    (["--grad-checkpointing"], ["--grad-checkpointing", "small_cnn"]),
    (["--model", "resnet18", "--drop-path", 0.1], ["--drop-path", "resnet18"]),
    (["--mixup", 0.2, "--model", "vae"], ["--mixup", "vae"]),
    (["--aa", "nonsense-policy"], ["--aa", "nonsense-policy"]),
    (["--opt", "nosuch"], ["--opt", "nosuch"]),
    (["--no-aug", "--reprob", 0.2], ["--no-aug"]),
    (["--remode", "blur"], ["remode"]),
    (["--smoothing", 1.5], ["--smoothing"]),
])
def test_settings_that_cannot_apply_are_refused_in_one_line(tmp_path, app, args, needles):
    result = app("--output-dir", tmp_path / "out", "--epochs", 1, *args)
    assert_refused(result, *needles)
    assert not (tmp_path / "out").exists()


def test_every_timm_flag_is_in_help_and_the_docs():
    from hvd_train.config import ALIASES, build_parser

    text = build_parser().format_help()
    readme = (TRAIN.parent / "docs" / "recipes.md").read_text()
    for flag in ("smoothing", "mixup", "cutmix", "mixup-prob", "mixup-switch-prob", "mixup-off-epoch", "aa",
                 "reprob", "remode", "color-jitter", "drop-path", "model-ema", "model-ema-decay", "model-ema-warmup",
                 "opt", "weight-decay", "sched", "layer-decay", "bce-loss", "checkpoint-hist", "grad-checkpointing",
                 "patience", "no-aug"):
        assert flag in ALIASES and (f"--{flag} " in text or f"--{flag}," in text), flag
        assert f"`--{flag}" in readme and f"`{ALIASES[flag]}`" in readme, flag


def test_recipes_name_their_source_and_augment():
    from hvd_train.config import load_recipe

    for name in ("cifar10_resnet18.yaml", "imagefolder_convnext.yaml"):
        path = TRAIN.parent / "configs" / name
        assert "Source:" in path.read_text()
        recipe = load_recipe(str(path))
        assert not recipe.get("aug", {}).get("no_aug", False)
    modern = load_recipe(str(TRAIN.parent / "configs" / "imagefolder_convnext.yaml"))
    assert modern["aug"]["mixup"] and modern["aug"]["cutmix"] and modern["aug"]["aa"] and modern["model"]["ema"]
    assert json.dumps(modern)  # plain values only


@pytest.mark.distributed
def test_the_weight_average_and_mixing_survive_an_elastic_reset(tmp_path):
    from conftest import elastic_run_losing_a_worker

    out = tmp_path / "run"
    elastic_run_losing_a_worker(tmp_path, "--output-dir", out, "--model-ema", "--model-ema-warmup", "--mixup", 0.2,
                                "--cutmix", 1.0, "--aa", "rand-m9-mstd0.5-inc1", "--smoothing", 0.1)
    s = read_json(out / "summary.json")
    assert s["elastic"]["resets"] >= 1 and s["ema_in_sync"] and all("val_ema_acc1" in r for r in s["history"])
    ckpt = torch.load(out / "checkpoints" / "last.pt", weights_only=True)
    # The average rolled back with the model at the reset: one update per optimizer step that counts.
    assert int(ckpt["ema"]["updates"]) == ckpt["step"]
