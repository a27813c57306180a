"""The process around the recipe: the `hvd-train` commands, the checks and settings before and after Horovod starts,
the modes that measure instead of training, and the one place that turns a failure into a message and an exit code.

train_hvd.py is the recipe itself; this module runs it (recipe_main, by its file) and never imports it by name.
"""
import importlib
import importlib.util
import logging
import sys
import time
import traceback
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Callable, NoReturn, Optional, Sequence, cast

import hvd_utils
from hvd_train.config import parse_config
from hvd_train.data import BadSampleError, DataError
from hvd_train.errors import (
    EXIT_BAD_DATA,
    EXIT_DIVERGED,
    EXIT_REFUSED,
    CheckpointError,
    ConfigError,
    NonFiniteLossError,
    say,
)
from hvd_train.files import keep_private
from hvd_train.guards import interrupt
from hvd_train.guards.watchdog import install_stack_dumps
from hvd_train.run.checkpoint import seed_generators
from hvd_train.run.directory import check_writable
from hvd_train.training import check_choices
from hvd_utils.runtime import under_elastic_launcher

if TYPE_CHECKING:
    from importlib.abc import Loader
    from importlib.machinery import ModuleSpec

    from hvd_train.config import Config

log = logging.getLogger("hvd_train")

# Before Horovod starts, a rank other than 0 that refuses its settings waits this long for the launcher to end it.
QUIET_RANK_WAIT_S = 60.0

# hvd-train SUBCOMMAND ...: the module whose main(argv) runs it, and what it does (`hvd-train --help` lists them).
SUBCOMMANDS = {
    "doctor": ("hvd_train.tools.doctor", "check the hosts of a job before it runs"),
    "shard": ("hvd_train.tools.shard", "write a data set as tar shards"),
    "export": ("hvd_train.tools.export", "the trained weights for use elsewhere (safetensors, TorchScript, ONNX)"),
    "predict": ("hvd_train.tools.predict", "the top classes of image files, from a run or an export"),
}


def cli(train: Optional[Callable[[], int]] = None) -> NoReturn:
    """`hvd-train [SUBCOMMAND] ...` and `python train_hvd.py ...`: a subcommand, or a training run of `train`
    (the recipe's main; by default the app's own train_hvd.py, recipe_main). Exits with the code."""
    keep_private()  # files this process writes: owner and group only (hvd_train/files.py)
    command = sys.argv[1] if len(sys.argv) > 1 else ""
    if command in SUBCOMMANDS:
        module = importlib.import_module(SUBCOMMANDS[command][0])
        sys.exit(module.main(sys.argv[2:]))
    train = train or recipe_main()
    sys.exit(guarded(train))


# train_hvd.py sits beside the package: in a checkout, and in site-packages where the wheel puts it (py_modules).
RECIPE = Path(__file__).resolve().parent.parent / "train_hvd.py"


def recipe_main() -> Callable[..., int]:
    """The recipe's main, from the app's own train_hvd.py: never a module of the user's that is named train_hvd
    and comes first on the module search path (a user's copy of the recipe, beside the script they launch)."""
    loaded = sys.modules.get("train_hvd")
    if loaded is not None and Path(getattr(loaded, "__file__", None) or "").resolve() == RECIPE:
        return loaded.main
    # The user's own train_hvd keeps its name; the app's recipe is then loaded under a name of the package's.
    name = "train_hvd" if loaded is None else "hvd_train._recipe"
    if name in sys.modules:
        return sys.modules[name].main
    spec = cast("ModuleSpec", importlib.util.spec_from_file_location(name, RECIPE))  # a .py file: always a spec
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    cast("Loader", spec.loader).exec_module(module)
    return module.main


def configure(argv: Optional[Sequence[str]] = None, cfg: "Optional[Config]" = None) -> "Config":
    """The run's settings (argv: the command line by default), checked before Horovod starts; the process's
    debugging aids switched on."""
    # `kill -USR2 <pid>` of a rank prints all its threads' Python stacks (while training on a fixed set of ranks,
    # every rank's: guards/watchdog.py): where a job is waiting.
    install_stack_dumps()
    keep_private()
    cfg = cfg or parse_config(argv)
    check_choices(cfg)
    if cfg.horovod.elastic and not under_elastic_launcher():
        raise ConfigError("--elastic needs horovodrun's elastic mode: horovodrun -np N --min-np M --max-np K "
                          "--host-discovery-script hostfiles/discover_hosts.py python train_hvd.py --elastic")
    if cfg.profile.enabled:  # before hvd.init(): Horovod's timeline can then be switched on for the profiled steps
        hvd_utils.timeline.enable_dynamic()
    return cfg


def watched(cfg: "Config") -> bool:
    """Whether a watchdog names a frozen rank: training on a fixed set of ranks."""
    return bool(not (cfg.horovod.elastic or cfg.benchmark.enabled or cfg.run.evaluate) and cfg.run.freeze_timeout_s)


def gloo_timeout_s(cfg: "Config") -> float:
    """How long a Gloo collective waits for a peer: under the watchdog longer than it, so that Gloo's own timeout
    (30 s) does not end the job first, blaming the ranks that waited; else Horovod's default."""
    return cfg.run.freeze_timeout_s + 60 if watched(cfg) else 0


def prepare_rank(cfg: "Config", rt: hvd_utils.Runtime) -> None:
    """After Horovod started: rank 0 alone speaks, Ctrl-C and SIGTERM say where the run stopped, each rank its own
    seed, and the output directory known to be writable before data and model are built."""
    # Only rank 0 speaks; the others report warnings and errors only.
    logging.basicConfig(level=logging.INFO if rt.is_main else logging.WARNING, format="%(message)s",
                        stream=sys.stdout)
    # The root logger's INFO is for the app's lines: matplotlib's first import on a machine logs "generated new
    # fontManager" at INFO, among the epoch lines (curves.png).
    logging.getLogger("matplotlib").setLevel(logging.WARNING)
    for note in getattr(cfg, "notes", ()):  # a resume or evaluation given a setting again, changed
        log.info("changed from the run's recorded settings: %s", note)
    interrupt.install(report=rt.is_main)
    if rt.device.type == "cuda" and rt.size > 1 and not hvd_utils.gpu_tensors_supported():
        # Every rank sees the same build: they all stop here, before Horovod is handed a CUDA tensor and aborts.
        raise ConfigError("this Horovod was built without CUDA (horovodrun --check-build lists no NCCL), so the ranks "
                          "cannot average gradients on their GPUs; rebuild it with `scripts/install.sh --gpu`, or "
                          "train on the CPUs with --device cpu")
    # torch's, CUDA's, Python's and NumPy's generators, each rank its own stream (dropout and a plug-in's draws
    # differ by rank; the weights come from rank 0); checkpoints save their states and a resume puts them back.
    seed_generators(cfg.run.seed + rt.rank)
    warn_of_many_workers(cfg.data.workers, rt)
    # (An elastic worker checks alone: one that joins later must not run a collective outside Horovod's loop.)
    if cfg.horovod.elastic:
        check_writable(cfg.run.output_dir, tidy=False)
    else:
        hvd_utils.decide_on_root(lambda: check_writable(cfg.run.output_dir), "output_dir_check")


def warn_of_many_workers(workers: int, rt: hvd_utils.Runtime) -> None:
    """More loader workers than this rank's share of the host's usable cores: said in one line by rank 0 (they
    only take turns on those cores, each with its own memory). torch's own warning of the same, a paragraph from
    each loader of each rank, is silenced: it fires only where this one does (above all the usable cores)."""
    cores = hvd_utils.usable_cpus()
    share = max(1, cores // rt.local_size)
    if workers <= share:
        return
    warnings.filterwarnings("ignore", message="This DataLoader will create", category=UserWarning)
    if rt.is_main:
        log.warning("warning: --workers %d: more loader workers than the %d core(s) each rank has here (%d usable, "
                    "%d rank(s) on this host); they take turns on them, each holding its own memory: --workers %d "
                    "is as many as run at once", workers, share, cores, rt.local_size, share)


def is_measurement(cfg: "Config") -> bool:
    """Whether the run measures instead of training: --benchmark (images/s) or --evaluate (a checkpoint)."""
    return cfg.benchmark.enabled or cfg.run.evaluate


def run_measurement(cfg: "Config", rt: hvd_utils.Runtime) -> int:
    from hvd_train.modes import benchmark, evaluate

    return benchmark.run(cfg, rt) if cfg.benchmark.enabled else evaluate.run(cfg, rt)


def leave_it_to_rank_0(error: Exception) -> None:
    """A rank other than 0 refused its settings before Horovod started. Rank 0 has the same settings: it refuses
    them too, says why, and exits, and the launcher then ends this rank. Exiting first instead would let the
    launcher end rank 0 before it has spoken. A rank still here after QUIET_RANK_WAIT_S failed alone (a recipe
    unreadable on its host, say): it says why itself."""
    time.sleep(QUIET_RANK_WAIT_S)
    say(f"train_hvd.py: rank {hvd_utils.launcher_rank()}: error: {error}")


def refused(error: Exception) -> int:
    """A setting or a file refused (exit 2; 3: the training diverged), raised on every rank at the same point
    (checked on all, or sent from rank 0), so none waits on another; rank 0 alone says it. Before Horovod started,
    the ranks of a fixed job agree on it first (the others stop at the same point, in hvd_utils.start)."""
    if not hvd_utils.started() and hvd_utils.launched_size() > 1 and not under_elastic_launcher():
        try:
            hvd_utils.start(refusal=str(error))
        except hvd_utils.SettingsRefused as agreed:
            return say_refusal(agreed)
    if hvd_utils.launcher_rank() == 0:
        say(f"train_hvd.py: error: {error}")
    elif not hvd_utils.started():  # an elastic worker: alone until Horovod's loop
        leave_it_to_rank_0(error)
    return EXIT_DIVERGED if isinstance(error, NonFiniteLossError) else EXIT_REFUSED


def say_refusal(agreed: hvd_utils.SettingsRefused) -> int:
    """Rank 0 says the refusal every rank agreed on, naming the rank that made it where that is not rank 0."""
    if hvd_utils.rank() == 0:
        where = f"rank {agreed.rank}: " if agreed.rank else ""
        say(f"train_hvd.py: {where}error: {agreed.message}")
    return EXIT_REFUSED


def guarded(run: Callable[[], int]) -> int:
    """run() with every failure reported once, as the command line and hvd_train.train() do; returns the exit code."""
    code = 1
    try:
        code = run()
    except (ConfigError, DataError, CheckpointError, NonFiniteLossError) as e:
        code = refused(e)
    except hvd_utils.SettingsRefused as e:  # another rank refused its settings (hvd_utils.start)
        code = say_refusal(e)
    except BadSampleError as e:
        # Met by this rank alone, mid-epoch: it names the file; the other ranks stop as their peer is gone (exit 1).
        say(f"train_hvd.py: rank {hvd_utils.launcher_rank()}: error: {e}")
        code = EXIT_BAD_DATA
    except interrupt.Interrupted as e:
        # Ctrl-C or SIGTERM: rank 0 says where the run stopped and where --resume auto continues.
        interrupt.report()
        code = e.exit_code
    except hvd_utils.PeerFailure:
        if interrupt.signalled():  # the signal reached another rank first, which ended the collective
            interrupt.report()
            code = 128 + cast(int, interrupt.signalled())
        else:
            # This rank was waiting in a collective when another one failed: that rank reports the cause.
            say(f"train_hvd.py: rank {hvd_utils.launcher_rank()}: stopping because another rank failed (its error is "
                f"reported above or by the launcher)")
            code = 1
    except Exception:
        # A bug or a fault on this rank alone: its traceback, once, with the rank named.
        say(f"train_hvd.py: rank {hvd_utils.launcher_rank()} failed:\n{traceback.format_exc()}")
        code = 1
    finally:
        hvd_utils.shutdown()
    return code
