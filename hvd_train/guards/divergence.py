"""A loss that went NaN or infinite, or grew far past the first step's: every rank learns it through one tiny
allreduce and stops at the same point, before a checkpoint replaces a good one."""
from typing import TYPE_CHECKING, Mapping, Optional

import torch

import hvd_utils
from hvd_train.errors import NonFiniteLossError

if TYPE_CHECKING:
    from hvd_train.trainer import Progress


def check_finite(total: Mapping[str, torch.Tensor], epoch: int, step: int,
                 progress: Optional["Progress"] = None) -> None:
    """Every rank learns whether any rank's running loss sum went NaN or infinite (one tiny allreduce and a host
    sync); raises NonFiniteLossError on every rank if so."""
    if hvd_utils.sum_across_ranks(~torch.isfinite(total["loss"]), name="nonfinite") > 0:
        if progress is not None:
            progress.close()
        raise NonFiniteLossError(f"the loss became NaN or infinite at epoch {epoch}, step {step} on at least one "
                                 f"rank; lower --lr, use --clip-grad, or check the data")


def first_loss(total: Mapping[str, torch.Tensor]) -> float:
    """The run's first step's loss, averaged over every rank's samples (one allreduce, once per run): what a
    diverging run is measured against."""
    sums = hvd_utils.allreduce_sums({"loss": total["loss"], "count": total["count"]}, name="first_loss")
    return sums["loss"] / max(1.0, sums["count"])


def check_divergence(train: Mapping[str, float], epoch: int, first: Optional[float], factor: float) -> None:
    """Training that diverged but stayed finite ends like a NaN: on every rank at once, before the epoch's
    checkpoint replaces a good one. The rule: the epoch's training loss (reduced over the ranks) is above `factor`
    times the run's first-step loss, where that is positive. The ranks agree through one tiny allreduce (an
    elastic worker that joined later may hold another first loss, or none)."""
    if not factor:
        return
    loss = train["loss"]
    diverged = first is not None and first > 0 and loss > factor * first
    if hvd_utils.sum_across_ranks(float(diverged), name="diverged") > 0:
        first = first if first is not None else float("nan")
        raise NonFiniteLossError(f"training diverged: the train loss of epoch {epoch} ({loss:.4g}) is more than "
                                 f"{factor:g}x the first step's ({first:.4g}); lower --lr, use --warmup-epochs or "
                                 f"--clip-grad, or pass --run.divergence_factor 0 if this loss may grow")
