"""Fine-tuning from weights the user has (--init-from) and freezing parameters by name (--freeze).

Weights come from a local file, never a download: a state dict saved with torch.save (.pt, .pth; read weights-only,
so the file cannot run code), a .safetensors file, or an hvd-train checkpoint. Tensors whose name and shape match
are loaded; the others keep the model's fresh initialisation, and the report says which: a classifier head built for
another number of classes is re-initialised that way.
"""
import fnmatch
import logging
import os
import pickle
import zipfile
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Collection, Iterator, Optional, Sequence

import torch
from torch import nn

from hvd_train.errors import ConfigError
from hvd_train.provenance import RecordError, plain
from hvd_train.run.checkpoint import unbounded_members

if TYPE_CHECKING:
    from hvd_train.config import ModelConfig

log = logging.getLogger("hvd_train")
WRAPPERS = ("module.", "_orig_mod.")  # DistributedDataParallel's and torch.compile's prefixes
SAFETENSORS_HEADER_MAX = 100_000_000  # safetensors' own bound on its JSON header, in bytes


def safetensors_problem(path: str) -> Optional[str]:
    """Why the file at `path` cannot be a whole safetensors file, from its first bytes (None: it may be one): it
    starts with the length of its JSON header (8 bytes, little-endian), which must fit in the file, then the
    header, a JSON object. Read before safetensors reads it, so a damaged or forged file is refused in one line."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(9)
    if len(head) < 9:
        return f"{size} bytes, fewer than a safetensors file starts with"
    length = int.from_bytes(head[:8], "little")
    if length > SAFETENSORS_HEADER_MAX or 8 + length > size:
        return (f"its first 8 bytes say its header takes {length:,} bytes, and the file has {size - 8:,} after "
                f"them")
    if head[8:9] != b"{":
        return "its header is not a JSON object"
    return None


def read_state_dict(path: str) -> dict[str, torch.Tensor]:
    """The tensors a weights file holds, by name."""
    if not os.path.isfile(path):
        raise ConfigError(f"--init-from {path}: no such file; give a local .pt, .pth or .safetensors file, or an "
                          f"hvd-train checkpoint (runs/NAME/checkpoints/last.pt)")
    expected = ("expected a state dict saved with torch.save(model.state_dict(), path), a .safetensors file or an "
                "hvd-train checkpoint")
    if not path.endswith(".safetensors"):
        # torch.save's zip archive only: the legacy format (torch before 1.6) allocates each tensor at the size the
        # file declares before reading it, and a compressed member inflates in memory.
        if not zipfile.is_zipfile(path):
            raise ConfigError(f"--init-from {path}: cannot be read as weights: not a zip archive as torch.save "
                              f"writes (a file cut short, another format, or torch's pre-1.6 format: load and save "
                              f"it again with a current torch); {expected}")
        unbounded = unbounded_members(path)
        if unbounded:
            raise ConfigError(f"--init-from {path}: {unbounded}; it is refused unread")
    elif (problem := safetensors_problem(path)) is not None:
        raise ConfigError(f"--init-from {path}: not a whole safetensors file: {problem}; it is refused unread; "
                          f"{expected}")
    try:
        if path.endswith(".safetensors"):
            from safetensors.torch import load_file

            return load_file(path, device="cpu")
        loaded = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        # torch's own message advises weights_only=False, which would run the file's code: not for our users.
        raise ConfigError(f"--init-from {path}: holds Python objects other than tensors and plain values, and is "
                          f"refused (loading those could run code); {expected}") from None
    except Exception as e:  # a damaged archive, a safetensors header that does not parse
        raise ConfigError(f"--init-from {path}: cannot be read as weights ({type(e).__name__}: "
                          f"{str(e).splitlines()[0] if str(e) else 'no detail'}); {expected}") from None
    try:  # the gate (hvd_train/provenance.py): plain values within bounds, shared references counted each time
        plain(loaded, f"--init-from {path}")
    except RecordError as e:
        raise ConfigError(f"{e}; {expected}") from None
    if isinstance(loaded, dict) and isinstance(loaded.get("model"), dict) and "epoch" in loaded:
        loaded = loaded["model"]  # an hvd-train checkpoint
    elif isinstance(loaded, dict) and isinstance(loaded.get("state_dict"), dict):
        loaded = loaded["state_dict"]  # the usual wrapper of other trainers' checkpoints
    tensors = {k: v for k, v in loaded.items() if torch.is_tensor(v)} if isinstance(loaded, dict) else {}
    if not tensors:
        raise ConfigError(f"--init-from {path}: holds no tensors by name ({type(loaded).__name__}); save the weights "
                          f"with torch.save(model.state_dict(), path)")
    return {_unwrapped(k): v for k, v in tensors.items()}


def _unwrapped(name: str) -> str:
    for prefix in WRAPPERS:
        while name.startswith(prefix):
            name = name[len(prefix):]
    return name


@dataclass
class InitReport:
    loaded: list[str] = field(default_factory=list)
    reshaped: list[tuple] = field(default_factory=list)  # (name, shape in the file, shape in the model)
    missing: list[str] = field(default_factory=list)   # in the model, not in the file
    unused: list[str] = field(default_factory=list)    # in the file, not in the model

    @property
    def total(self) -> int:
        return len(self.loaded) + len(self.reshaped) + len(self.missing)

    def lines(self, path: str) -> Iterator[str]:
        yield f"--init-from {path}: loaded {len(self.loaded)} of the model's {self.total} tensors"
        if self.reshaped:
            yield "  re-initialised, another shape in the file: " + ", ".join(
                f"{n} {list(a)} -> {list(b)} ({why_reshaped(a, b)})" for n, a, b in self.reshaped)
        if self.missing:
            yield "  not in the file, left as initialised: " + _few(self.missing)
        if self.unused:
            yield "  in the file but not in the model, ignored: " + _few(self.unused)


def why_reshaped(in_file: Sequence[int], in_model: Sequence[int]) -> str:
    """What a shape difference means: another number of outputs (a classifier head for another number of classes),
    of inputs (a first layer for another number of image channels), or another shape altogether."""
    if len(in_file) == len(in_model) and len(in_file) >= 1 and in_file[1:] == in_model[1:]:
        return f"{in_file[0]} outputs in the file, {in_model[0]} here: a head for another number of classes"
    if len(in_file) == len(in_model) and len(in_file) >= 2 and in_file[0] == in_model[0] and \
            in_file[2:] == in_model[2:]:
        return (f"{in_file[1]} inputs in the file, {in_model[1]} here: a first layer for another number of input "
                f"channels")
    return "another shape"


def _few(names: Sequence[str], shown: int = 8) -> str:
    return ", ".join(names[:shown]) + (f" and {len(names) - shown} more" if len(names) > shown else "")


SHARE = 0.5  # below this share of the model's tensors loaded, the file is taken for another network's weights


def load_matching(model: nn.Module, path: str, partial: bool = False) -> InitReport:
    """Load into `model` every tensor of the file at `path` whose name and shape match; returns the InitReport. A
    file of which fewer than SHARE of the model's tensors load is refused (most likely another network's weights),
    unless `partial` (--model.init_partial) asks for that."""
    source = read_state_dict(path)
    target = model.state_dict()
    report, update = InitReport(), {}
    for name, tensor in target.items():
        key = _unwrapped(name)
        if key not in source:
            report.missing.append(key)
        elif source[key].shape != tensor.shape:
            report.reshaped.append((key, tuple(source[key].shape), tuple(tensor.shape)))
        else:
            update[name] = source[key]
            report.loaded.append(key)
    wanted = {_unwrapped(n) for n in target}
    report.unused = [k for k in source if k not in wanted]
    if not report.loaded:
        raise ConfigError(f"--init-from {path}: none of its {len(source)} tensors fits this model (names such as "
                          f"{_few(sorted(source), 3)}; the model has {_few(sorted(wanted), 3)}); is it the weights "
                          f"of another architecture?")
    if len(report.loaded) < SHARE * report.total and not partial:
        shown = "; ".join(f"{n} {list(a)} -> {list(b)} ({why_reshaped(a, b)})" for n, a, b in report.reshaped[:2])
        raise ConfigError(f"--init-from {path}: only {len(report.loaded)} of the model's {report.total} tensors fit "
                          f"(fewer than {SHARE:.0%}): {len(report.missing)} are not in the file"
                          f"{', ' + str(len(report.reshaped)) + ' have another shape (' + shown + ')' if shown else ''}"
                          f"; is it the weights of another network? Pass --model.init_partial to load the "
                          f"{len(report.loaded)} anyway")
    model.load_state_dict(update, strict=False)
    return report


def freeze_configured(model: nn.Module, model_cfg: "ModelConfig") -> None:
    """--freeze (and --model.freeze_bn_stats) on `model`, each said in one line; nothing without --freeze."""
    if not model_cfg.freeze_patterns:
        return
    frozen = freeze(model, model_cfg.freeze_patterns)
    held = hold_batch_norm(model, frozen) if model_cfg.freeze_bn_stats else []
    if held:
        log.info("--freeze: %d BatchNorm layer(s) frozen with their running statistics (--model.freeze_bn_stats "
                 "false keeps those updating)", len(held))
    log.info("--freeze %s: %d tensor(s) of %.2fM parameters kept fixed: %s", model_cfg.freeze, len(frozen),
             sum(p.numel() for n, p in model.named_parameters() if n in frozen) / 1e6, ", ".join(frozen[:6]) +
             (f" and {len(frozen) - 6} more" if len(frozen) > 6 else ""))


def freeze(model: nn.Module, patterns: Sequence[str]) -> list[str]:
    """Switch off the gradients of the parameters whose names match any glob in `patterns`; returns their names.
    Frozen parameters are left out of the optimizer and so out of Horovod's allreduce."""
    names = [n for n, _ in model.named_parameters()]
    for pattern in patterns:
        if not any(fnmatch.fnmatchcase(n, pattern) for n in names):
            raise ConfigError(f"--freeze {pattern!r} matches no parameter of the model; its names look like "
                              f"{_few(names, 4)} (globs: conv1.*, layer1.*)")
    frozen = [n for n, p in model.named_parameters() if any(fnmatch.fnmatchcase(n, pat) for pat in patterns)]
    if len(frozen) == len(names):
        raise ConfigError(f"--freeze {','.join(patterns)}: matches every parameter, so nothing would train")
    for n, p in model.named_parameters():
        if n in frozen:
            p.requires_grad_(False)
    return frozen


def hold_batch_norm(model: nn.Module, frozen: Collection[str]) -> list[str]:
    """BatchNorm layers whose parameters are all frozen keep their running statistics too (they stay in eval mode
    through every forward, whatever model.train() says): a frozen backbone is the network as it was trained, and
    statistics drifting under it would change its features. Returns their names."""
    held = []
    for name, module in model.named_modules():
        params = [f"{name}.{p}" if name else p for p, _ in module.named_parameters(recurse=False)]
        if isinstance(module, nn.modules.batchnorm._BatchNorm) and params and all(p in frozen for p in params):
            module.register_forward_pre_hook(_in_eval_mode)
            held.append(name)
    return held


def _in_eval_mode(module: nn.Module, args: tuple[Any, ...]) -> None:
    module.training = False
