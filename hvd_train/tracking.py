"""Experiment tracking on rank 0: MLflow (--mlflow, --mlflow-uri).

What is logged: the resolved config as parameters; tags for the world size, controller and Horovod version; each
epoch's record (the same exact sums as metrics.jsonl) as metrics at step = epoch; at the end the summary's numbers as
metrics, and summary.json, metrics.jsonl, config.json and curves.png as artifacts.

One run, one history. A record is sent once its epoch is committed, that is once the checkpoint that holds it is
written (every epoch by default): an epoch that a crash makes the resumed run train again was never sent, so no epoch
appears twice. The MLflow run's id is kept in the checkpoint; --resume continues that run.

A tracking server that is down or refuses a write never stops training: the first failure is one warning, the
records meanwhile are kept and sent again at the end, and what still could not be sent is said then.
"""
import logging
import math
import os
import time
from importlib import metadata

log = logging.getLogger("hvd_train")

# MLflow's client retries a failed request 7 times with exponential backoff (minutes): a server that is down
# would hold rank 0, and with it every rank, for that long at each epoch. A user's own settings win.
CLIENT_SETTINGS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
                   "MLFLOW_HTTP_REQUEST_TIMEOUT": "20"}
PARAMS_PER_CALL = 100  # MLflow's limit per log_batch


def local_uri(output_dir):
    """The store used without --mlflow-uri: a SQLite file in the output directory (`mlflow ui --backend-store-uri`
    opens it)."""
    return "sqlite:///" + os.path.abspath(os.path.join(output_dir, "mlflow.db"))


def flatten(config, prefix=""):
    """{'optim.lr': 0.1, ...} from the nested config dict."""
    out = {}
    for key, value in config.items():
        if isinstance(value, dict) and value and prefix == "":
            out.update(flatten(value, f"{key}."))
        else:
            out[prefix + key] = value
    return out


class MlflowTracker:
    name = "mlflow"

    def __init__(self, cfg, rt, run_id=None):
        for key, value in CLIENT_SETTINGS.items():
            os.environ.setdefault(key, value)
        self.uri = cfg.logging.mlflow_uri or local_uri(cfg.run.output_dir)
        self.run_id, self.pending, self.failed = run_id, [], []
        self.down = self.warned = False  # the server failed once this run; that was said
        self._call("the run's start", lambda: self._start(cfg, rt))

    def _start(self, cfg, rt):
        from mlflow.entities import Param, RunTag
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(tracking_uri=self.uri)
        tags = {"world_size": rt.size, "controller": rt.controller, "horovod_version": _version("horovod"),
                "hvd_train.output_dir": os.path.abspath(cfg.run.output_dir)}
        if self.run_id:  # a resumed run continues its MLflow run
            self.client.update_run(self.run_id, status="RUNNING")
            logged = self.client.get_run(self.run_id).data.params
            tags["resumed_world_size"] = tags.pop("world_size")
        else:
            experiment = self.client.get_experiment_by_name(cfg.logging.mlflow_experiment)
            if experiment is None:
                # Artifacts of the local store go beside it (MLflow's default is ./mlruns in the working directory).
                location = None if cfg.logging.mlflow_uri else \
                    "file://" + os.path.abspath(os.path.join(cfg.run.output_dir, "mlflow-artifacts"))
                experiment_id = self.client.create_experiment(cfg.logging.mlflow_experiment, location)
            else:
                experiment_id = experiment.experiment_id
            name = cfg.run.name or os.path.basename(os.path.abspath(cfg.run.output_dir))
            self.run_id = self.client.create_run(experiment_id, run_name=name).info.run_id
            logged = {}
        # Parameters cannot change in MLflow: a resumed run adds those it did not have (a changed --epochs is in
        # config.json and the summary's resumes).
        params = [Param(k, str(v)[:6000]) for k, v in flatten(cfg.to_dict()).items() if k not in logged]
        for i in range(0, len(params), PARAMS_PER_CALL):
            self.client.log_batch(self.run_id, params=params[i:i + PARAMS_PER_CALL])
        self.client.log_batch(self.run_id, tags=[RunTag(k, str(v)) for k, v in tags.items()])
        log.info("MLflow: run %s in %s", self.run_id, self.uri)

    def epoch(self, record, committed):
        """Keep the epoch's record; send what is committed (this epoch and those kept before it)."""
        self.pending.append(record)
        if committed:
            self._send_pending()

    def _send_pending(self):
        from mlflow.entities import Metric

        if not self.pending:
            return
        stamp = int(time.time() * 1000)
        metrics = [Metric(k, float(v), stamp, r["epoch"]) for r in self.pending for k, v in r.items()
                   if k != "epoch" and _number(v)]
        epochs = [r["epoch"] for r in self.pending]
        if self._call(f"the metrics of epoch(s) {_span(epochs)}",
                      lambda: self.client.log_batch(self.run_id, metrics=metrics)):
            self.pending = []

    def finish(self, summary, files, status="FINISHED"):
        """The records still kept, the summary's numbers and the files; then the run's status. Says what could not
        be sent."""
        from mlflow.entities import Metric

        if self.run_id is None:
            log.warning("MLflow (%s): nothing was logged: the run could not be started", self.uri)
            return
        self.down, self.failed = False, []  # a server that was down may be back: everything is tried once more
        if status == "FINISHED":  # (a run that stopped early keeps its uncommitted epochs out: they are redone)
            self._send_pending()
        if summary:
            stamp, step = int(time.time() * 1000), summary.get("epochs") or 0
            per_epoch = set(summary["history"][-1]) if summary.get("history") else set()  # (the lr is in both)
            final = [Metric(k, float(v), stamp, step) for k, v in summary.items() if _number(v) and k not in per_epoch]
            self._call("the summary's metrics", lambda: self.client.log_batch(self.run_id, metrics=final))
        for path in files:
            if path and os.path.exists(path):
                self._call(os.path.basename(path), lambda p=path: self.client.log_artifact(self.run_id, p))
        self._call("the run's end", lambda: self.client.set_terminated(self.run_id, status))
        if self.failed:
            log.warning("MLflow (%s): not logged: %s", self.uri, "; ".join(self.failed))

    def _call(self, what, fn):
        """fn(), unless the server was found down; a failure is said once (the first) and never stops training.
        Returns whether fn() succeeded."""
        if not self.down:
            try:
                fn()
                return True
            except Exception as e:  # the server down, refusing a write, a store that cannot be opened: all alike
                self.down = True
                if not self.warned:
                    self.warned = True
                    first = next((line for line in str(e).splitlines() if line.strip()), type(e).__name__)
                    log.warning("MLflow (%s): could not log %s (%s: %s); training goes on, and what is not "
                                "logged is said at the end", self.uri, what, type(e).__name__, first[:300])
        self.failed.append(what)
        return False


def _number(value):
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _span(epochs):
    return f"{epochs[0]}-{epochs[-1]}" if len(epochs) > 1 else str(epochs[0])


def _version(package):
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "unknown"


def open_trackers(cfg, rt, tracking):
    """The trackers this run logs to, on rank 0 (none elsewhere). `tracking`: the run ids a resumed checkpoint
    holds, by tracker; updated with this run's ids."""
    if not rt.is_main or not (cfg.logging.mlflow or cfg.logging.mlflow_uri):
        return []
    tracker = MlflowTracker(cfg, rt, tracking.get("mlflow"))
    if tracker.run_id:
        tracking["mlflow"] = tracker.run_id
    return [tracker]
