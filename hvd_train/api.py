"""hvd_train.train(): the whole app (Horovod, sharding, exact metrics, checkpoints and exact resume, elastic mode, the
watchdog, reports) around objects a user's own script made, for users who keep their script.

    # my_train.py; launch: horovodrun -np 4 -H host1:2,host2:2 python my_train.py --epochs 10 --output-dir runs/a
    import sys
    import hvd_train

    if __name__ == "__main__":
        train_set, val_set = make_my_sets()
        sys.exit(hvd_train.train(model=MyNet(), train_set=train_set, val_set=val_set, task=MyTask(),
                                 facts={"num_classes": 10}))

Every setting comes from the command line (or --config), as for train_hvd.py. The objects become the run's model,
data sets and task through the same mechanism as --model package.module:name (hvd_train/registry.py), named after
their classes (`__main__:MyNet`): checkpoints record those names, so a resume with other objects is refused.
"""
import inspect
import sys
from typing import TYPE_CHECKING, Any, Callable, Mapping, Optional, Sequence, Union

from torch import nn

from hvd_train.registry import PROVIDED

if TYPE_CHECKING:
    from torch.utils.data import Dataset


def train(model: Union[nn.Module, Callable[..., nn.Module], None] = None, train_set: "Optional[Dataset]" = None,
          val_set: "Optional[Dataset]" = None, task: object = None, facts: Optional[Mapping[str, Any]] = None,
          argv: Optional[Sequence[str]] = None) -> int:
    """Train `model` (an nn.Module, or a factory called with the data's facts it names) on `train_set` (and
    `val_set`; None: the app's split of train_set) with `task` (an instance or a class of the task interface,
    hvd_train/tasks.py), under the settings of `argv` (default: the command line). Each argument left out keeps
    the setting's choice (--model, --dataset, --task). Returns the exit code, as train_hvd.py's."""
    from hvd_train import app

    chosen = []
    if model is not None:
        chosen += ["--model", _provide(model, (lambda **_: model) if isinstance(model, nn.Module) else model)]
    if train_set is not None:
        chosen += ["--dataset", _provide(train_set, lambda: (train_set, val_set, dict(facts or {})))]
    elif val_set is not None or facts:
        raise TypeError("hvd_train.train(): val_set and facts belong to a train_set; pass train_set too")
    if task is not None:
        chosen += ["--task", _provide(task, task if inspect.isclass(task) else (lambda: task))]
    args = list(sys.argv[1:] if argv is None else argv) + chosen
    return app.guarded(lambda: app.recipe_main()(args))


def _provide(obj: object, factory: Callable[..., Any]) -> str:
    """Register `factory` under the name of obj's class (or of obj, a class or function); returns the name."""
    named = obj if inspect.isclass(obj) or inspect.isfunction(obj) else type(obj)
    name = f"{named.__module__}:{named.__qualname__}"
    PROVIDED[name] = factory
    return name
