"""Deterministic train/validation split: the same on every rank and in every run with the same seed."""
import torch


def split_indices(num_samples, val_fraction, seed):
    """Shuffle 0..num_samples-1 with a fixed seed; the first val_fraction go to validation, the rest to training."""
    if num_samples < 2:
        raise ValueError(f"cannot split {num_samples} sample(s) into training and validation sets")
    num_val = min(num_samples - 1, max(1, round(num_samples * val_fraction)))
    order = torch.randperm(num_samples, generator=torch.Generator().manual_seed(seed)).tolist()
    return sorted(order[num_val:]), sorted(order[:num_val])
