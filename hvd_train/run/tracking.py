"""Experiment tracking on rank 0: MLflow (--mlflow, --mlflow-uri) and Weights & Biases offline (--wandb).

What is logged: the resolved config as parameters; the world size, controller and Horovod version; each epoch's
record (the same exact sums as metrics.jsonl) as metrics at step = epoch; at the end the summary's numbers, and
summary.json, metrics.jsonl, config.json and curves.png as files.

One run, one history. A record is sent once its epoch is committed, that is once the checkpoint that holds it is
written (every epoch by default): an epoch that a crash makes the resumed run train again was never sent, so no epoch
appears twice. Each tracker's run id is kept in the checkpoint; --resume continues that run.

A tracker that fails (a server down or refusing a write, a full disk) never stops training: the first failure is one
warning, the records meanwhile are kept and sent again at the end, and what still could not be sent is said then.
"""
import logging
import math
import os
import secrets
import shutil
import sys
import time
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Optional

from hvd_train.errors import CheckpointError, redact, redact_argument, split_credentials
from hvd_train.files import no_link_below
from hvd_train.run.directory import RunDir

if TYPE_CHECKING:
    from hvd_train.config import Config
    from hvd_train.run.state import RunState
    from hvd_utils import Runtime

log = logging.getLogger("hvd_train")

# MLflow's client retries a failed request 7 times with exponential backoff (minutes): a server that is down
# would hold rank 0, and with it every rank, for that long at each epoch. A user's own settings win.
MLFLOW_CLIENT_SETTINGS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
                          "MLFLOW_HTTP_REQUEST_TIMEOUT": "20"}
PARAMS_PER_CALL = 100  # MLflow's limit per log_batch
FINAL = ("best_", "final_", "train_samples_per_sec", "process_wall_seconds")  # the summary's numbers logged at the end


def local_uri(output_dir: str) -> str:
    """The MLflow store used without --mlflow-uri: a SQLite file in the output directory (`mlflow ui
    --backend-store-uri` opens it)."""
    return "sqlite:///" + os.path.abspath(RunDir(output_dir).mlflow_db)


def local_mlflow(cfg: "Config") -> bool:
    """Whether the run logs to the MLflow store in its output directory (--mlflow without --mlflow-uri)."""
    return bool(cfg.logging.mlflow and not cfg.logging.mlflow_uri)


def flatten(config: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """{'optim.lr': 0.1, ...} from the nested config dict (a plug-in's argument mapping stays one value)."""
    return {f"{section}.{key}": value for section, fields in config.items() for key, value in fields.items()}


def run_facts(rt: "Runtime") -> dict[str, object]:
    return {"world_size": rt.size, "controller": rt.controller, "horovod_version": _version("horovod")}


class Tracker:
    """The rules every tracker follows; a subclass says how to start, send records, the summary and files, and end.
    `where` names the tracker in messages; `run_id` is set once its run exists."""
    where = ""
    name: str  # the key of its run id in the run state (state.tracking)
    run_id: Optional[str]
    pending: list[dict[str, Any]]
    failed: list[str]
    # What a subclass defines:
    send: Callable[[list[dict[str, Any]]], None]
    send_summary: Callable[[dict[str, float], int], None]
    send_file: Callable[[str], None]
    end: Callable[[str], None]

    def __init__(self, run_id: Optional[str]) -> None:
        self.run_id, self.pending, self.failed = run_id, [], []
        self.down = self.warned = False  # it failed once this run; that was said

    def epoch(self, record: dict[str, Any], committed: bool) -> None:
        """Keep the epoch's record; send what is committed (this epoch and those kept before it)."""
        self.pending.append(record)
        if committed:
            self._send_pending()

    def _send_pending(self) -> None:
        if self.pending and self._call(f"the metrics of epoch(s) {_span([r['epoch'] for r in self.pending])}",
                                       lambda: self.send(self.pending)):
            self.pending = []

    def end_run(self, summary: Optional[dict[str, Any]], files: Iterable[Optional[str]],
                status: str = "FINISHED") -> None:
        """The records still kept (a finished run), the summary's numbers and the files; then the run's status.
        Says what could not be sent."""
        if self.run_id is None:
            log.warning("%s: nothing was logged: the run could not be started", self.where)
            return
        self.down, self.failed = False, []  # whatever failed may work now: everything is tried once more
        if status == "FINISHED":  # (a run that stopped early keeps its uncommitted epochs out: they are redone)
            self._send_pending()
        if summary:
            # The run's results; its settings (batch sizes, learning rates, ranks) are parameters and tags already.
            final = {k: v for k, v in summary.items() if _number(v) and k.startswith(FINAL)}
            self._call("the summary's metrics", lambda: self.send_summary(final, summary.get("epochs") or 0))
        for path in files:
            if path and os.path.exists(path):
                self._call(os.path.basename(path), lambda p=path: self.send_file(p))
        self._call("the run's end", lambda: self.end(status))
        if self.failed:
            log.warning("%s: not logged: %s", self.where, "; ".join(self.failed))

    def _call(self, what: str, fn: Callable[..., object]) -> bool:
        """fn(), unless this tracker was found failing; the first failure is said, none stops training. Returns
        whether fn() succeeded."""
        if not self.down:
            try:
                fn()
                return True
            except Exception as e:  # a server down or refusing a write, a store that cannot be opened: all alike
                self.down = True
                if not self.warned:
                    self.warned = True
                    first = next((line for line in str(e).splitlines() if line.strip()), type(e).__name__)
                    log.warning("%s: could not log %s (%s: %s); training goes on, and what is not logged is said "
                                "at the end", self.where, what, type(e).__name__, first[:300])
        self.failed.append(what)
        return False


def with_credentials_in_env(uri: str) -> str:
    """The tracking URI without its user info, which moves to MLflow's own environment variables (a user and
    password to MLFLOW_TRACKING_USERNAME/PASSWORD, a lone token to MLFLOW_TRACKING_TOKEN; ones already set win), so
    the client authenticates while nothing the run stores or prints holds the secret."""
    clean, user, password = split_credentials(uri)
    if user and password:
        os.environ.setdefault("MLFLOW_TRACKING_USERNAME", user)
        os.environ.setdefault("MLFLOW_TRACKING_PASSWORD", password)
    elif user:
        os.environ.setdefault("MLFLOW_TRACKING_TOKEN", user)
    return clean


def keeps_files_in(local: Optional[RunDir], what: str, location: object) -> None:
    """An experiment or run of the output directory's store (`local`, a RunDir; None: a store of the user's
    --mlflow-uri) must keep its files in mlflow-artifacts/: MLflow writes them, and sends them with the user's
    credentials, wherever its artifact location says."""
    if local is not None and not local.holds_artifacts(location):
        raise CheckpointError(f"{local.mlflow_db}: {what} keeps its files at {redact(str(location))}, outside "
                              f"{local.mlflow_artifacts}; nothing is logged there")


class MlflowTracker(Tracker):
    name = "mlflow"

    def __init__(self, cfg: "Config", rt: "Runtime", run_id: Optional[str] = None) -> None:
        super().__init__(run_id)
        for key, value in MLFLOW_CLIENT_SETTINGS.items():
            os.environ.setdefault(key, value)
        self.uri = with_credentials_in_env(cfg.logging.mlflow_uri) or local_uri(cfg.run.output_dir)
        self.where = f"MLflow ({redact(self.uri)})"
        self._call("the run's start", lambda: self.start(cfg, rt))

    def start(self, cfg: "Config", rt: "Runtime") -> None:
        from mlflow.entities import Param, RunTag
        from mlflow.tracking import MlflowClient

        # The local store is the output directory's: checked again as the claim checked it (a link or a store planted
        # since), before MLflow opens it; the experiment and the run it gives must keep their files in there.
        local = None if cfg.logging.mlflow_uri else RunDir(cfg.run.output_dir)
        if local is not None:
            local.refuse_planted()
        self.client = MlflowClient(tracking_uri=self.uri)
        tags = {**run_facts(rt), "hvd_train.output_dir": os.path.abspath(cfg.run.output_dir)}
        if self.run_id:  # a resumed run continues its MLflow run
            run = self.client.get_run(self.run_id)
            keeps_files_in(local, f"its run {self.run_id}", run.info.artifact_uri)
            self.client.update_run(self.run_id, status="RUNNING")
            logged = run.data.params
            tags["resumed_world_size"] = tags.pop("world_size")
        else:
            experiment = self.client.get_experiment_by_name(cfg.logging.mlflow_experiment)
            if experiment is None:
                # Artifacts of the local store go beside it (MLflow's default is ./mlruns in the working directory).
                location = None if local is None else Path(os.path.abspath(local.mlflow_artifacts)).as_uri()
                experiment_id = self.client.create_experiment(cfg.logging.mlflow_experiment, location)
            else:
                keeps_files_in(local, f"its experiment {experiment.name!r}", experiment.artifact_location)
                experiment_id = experiment.experiment_id
            self.run_id = self.client.create_run(experiment_id, run_name=run_name(cfg)).info.run_id
            logged = {}
        # Parameters cannot change in MLflow: a resumed run adds those it did not have (a changed --epochs is in
        # config.json and the summary's resumes).
        params = [Param(k, str(v)[:6000]) for k, v in flatten(cfg.to_dict()).items() if k not in logged]
        for i in range(0, len(params), PARAMS_PER_CALL):
            self.client.log_batch(self.run_id, params=params[i:i + PARAMS_PER_CALL])
        self.client.log_batch(self.run_id, tags=[RunTag(k, str(v)) for k, v in tags.items()])
        log.info("MLflow: run %s in %s", self.run_id, redact(self.uri))

    def send(self, records: list[dict[str, Any]]) -> None:
        from mlflow.entities import Metric

        stamp = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, float(v), stamp, r["epoch"]) for r in records
                                                    for k, v in r.items() if k != "epoch" and _number(v)])

    def send_summary(self, values: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        stamp = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, float(v), stamp, step) for k, v in values.items()])

    def send_file(self, path: str) -> None:
        self.client.log_artifact(self.run_id, path)

    def end(self, status: str) -> None:
        self.client.set_terminated(self.run_id, status)


class WandbTracker(Tracker):
    """Weights & Biases in offline mode: a run directory under <output dir>/wandb that `wandb sync` uploads later;
    nothing is sent over the network while training."""
    name = "wandb"

    def __init__(self, cfg: "Config", rt: "Runtime", run_id: Optional[str] = None) -> None:
        super().__init__(run_id)
        self.run_dir = RunDir(cfg.run.output_dir)
        self.where = f"W&B ({self.run_dir.wandb})"
        self._call("the run's start", lambda: self.start(cfg, rt))

    def start(self, cfg: "Config", rt: "Runtime") -> None:
        import wandb

        no_link_below(self.run_dir.root, self.run_dir.wandb)  # W&B writes into <dir>/wandb: the directory's own

        run_id = self.run_id or secrets.token_hex(4)  # W&B's ids: short, lowercase
        # W&B records the process's command line in the run's metadata: it sees it with its URIs redacted.
        argv = sys.argv
        sys.argv = [redact_argument(a) for a in argv]
        try:
            self.run = wandb.init(mode="offline", dir=cfg.run.output_dir, project=cfg.logging.wandb_project,
                                  name=run_name(cfg), id=run_id, resume="allow",
                                  config={**flatten(cfg.to_dict()), **run_facts(rt)},
                                  settings=wandb.Settings(silent=True, x_disable_stats=True))
        finally:
            sys.argv = argv
        self.run_id = run_id
        log.info("W&B: offline run %s in %s (upload it with: wandb sync %s)", run_id, self.run.dir,
                 os.path.dirname(self.run.dir))

    def send(self, records: list[dict[str, Any]]) -> None:
        for r in records:
            self.run.log({k: v for k, v in r.items() if k != "epoch" and _number(v)}, step=r["epoch"])

    def send_summary(self, values: dict[str, float], step: int) -> None:
        self.run.summary.update(values)

    def send_file(self, path: str) -> None:
        # A copy in the run's files/ (which `wandb sync` uploads): the output directory's files change on a resume.
        shutil.copy2(path, self.run.dir)

    def end(self, status: str) -> None:
        self.run.finish(exit_code=0 if status == "FINISHED" else 1)


def run_name(cfg: "Config") -> str:
    return cfg.run.name or os.path.basename(os.path.abspath(cfg.run.output_dir))


def _number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _span(epochs: list[int]) -> str:
    return f"{epochs[0]}-{epochs[-1]}" if len(epochs) > 1 else str(epochs[0])


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "unknown"


def open_trackers(cfg: "Config", rt: "Runtime", state: "RunState") -> list[Tracker]:
    """The trackers this run logs to, on rank 0 (none elsewhere). They continue the runs whose ids the resumed
    checkpoint holds (state.tracking), and the state keeps their ids for the next checkpoints."""
    if not rt.is_main:
        return []
    wanted = [(cfg.logging.mlflow or bool(cfg.logging.mlflow_uri), MlflowTracker), (cfg.logging.wandb, WandbTracker)]
    trackers = [kind(cfg, rt, state.tracking.get(kind.name)) for on, kind in wanted if on]
    state.tracked_as({t.name: t.run_id for t in trackers if t.run_id})
    return trackers
