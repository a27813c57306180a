"""What a step does to a batch before the model sees it: the device it moves to, the mixed-precision context of the
forward pass, and the cut into parts for gradient accumulation."""
import contextlib

import torch

from hvd_train.run_task import first_tensor


def autocast(device, amp):
    """Mixed precision for the forward pass: bf16 (CPU and GPU) or fp16 (GPU); off gives a no-op context."""
    if amp == "off":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16 if amp == "bf16" else torch.float16)


def to_device(batch, device):
    """The batch's tensors on `device` (through tuples, lists and dicts); anything else as it is."""
    if torch.is_tensor(batch):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, dict):
        return {key: to_device(value, device) for key, value in batch.items()}
    if isinstance(batch, (tuple, list)):
        return type(batch)(to_device(value, device) for value in batch)
    return batch


def split_batch(batch, parts):
    """The batch cut into `parts` along its first dimension (fewer where it has fewer samples): each tensor is cut,
    tuples, lists and dicts keep their shape, anything else goes into every part."""
    first = first_tensor(batch)
    count = len(first.chunk(parts)) if first is not None else 1

    def part(x, i):
        if torch.is_tensor(x):
            return x.chunk(parts)[i] if x.dim() else x
        if isinstance(x, dict):
            return {key: part(value, i) for key, value in x.items()}
        if isinstance(x, (tuple, list)):
            return type(x)(part(value, i) for value in x)
        return x

    return [part(batch, i) for i in range(count)]
