"""The sections of how the job runs: Horovod, checkpoints, logging and trackers, the run itself, benchmark mode,
profiling."""

from dataclasses import dataclass

from hvd_train.config.fields import DEVICES, PROFILE_RANKS, _Section, _choice, _require, opt


@dataclass
class HorovodConfig(_Section):
    batches_per_allreduce: int = opt(1, "backward passes summed locally before one allreduce (gradient accumulation)",
                                     flags=("batches-per-allreduce",))
    fp16_allreduce: bool = opt(False, "compress gradients to fp16 for the allreduce (half the bytes on the wire)",
                               flags=("fp16-allreduce",))
    bf16_allreduce: bool = opt(False, "send gradients as bfloat16 (half the bytes, float32's range: no overflow "
                               "where fp16's 65504 ends); summed in float32 and rounded once",
                               flags=("bf16-allreduce",))
    use_adasum: bool = opt(False, "combine gradients with Adasum instead of averaging them", flags=("use-adasum",))
    shard_optimizer: bool = opt(False, "ZeRO-1: each rank keeps the optimizer state of 1/N of the weights "
                                "(reducescatter, step a slice, allgather); element-wise optimizers",
                                flags=("shard-optimizer",))
    powersgd_rank: int = opt(0, "average the gradients as PowerSGD low-rank factors of this rank, with error "
                             "feedback (1-4; far fewer bytes on slow links, docs/speed.md); 0: off",
                             flags=("powersgd-rank",))
    powersgd_start_step: int = opt(-1, "PowerSGD: optimizer steps of plain averaging before the compression starts "
                                   "(-1: 10% of the run's steps)", flags=("powersgd-start-step",))
    powersgd_min_compression: float = opt(2.0, "PowerSGD: a tensor whose factors would not be this many times "
                                          "smaller goes through the plain average (1-d tensors always do)",
                                          flags=("powersgd-min-compression",))
    gradient_predivide_factor: float = opt(1.0, "divide gradients by this before the allreduce, the rest after")
    sync_bn: bool = opt(False, "batch-norm statistics computed over all ranks (hvd.SyncBatchNorm)", flags=("sync-bn",))
    elastic: bool = opt(False, "elastic training under horovodrun --min-np/--max-np --host-discovery-script",
                        flags=("elastic",))
    commit_every: int = opt(20, "elastic: steps between state commits (at most this many are redone on a reset)")
    fusion_threshold_mb: float = opt(-1.0, "tensor fusion buffer, MB (0: none; -1: 8 on CPUs, 128 on GPUs); "
                                     "docs/speed.md")
    cycle_time_ms: float = opt(0.0, "Horovod's cycle, ms (0: by launch, docs/speed.md); launcher flags win")

    def __post_init__(self):
        super().__post_init__()
        _require(self.batches_per_allreduce >= 1, "horovod.batches_per_allreduce (--batches-per-allreduce)",
                 self.batches_per_allreduce, "must be 1 or more")
        _require(self.gradient_predivide_factor > 0, "horovod.gradient_predivide_factor",
                 self.gradient_predivide_factor, "must be positive")
        _require(self.commit_every >= 1, "horovod.commit_every", self.commit_every, "must be 1 or more steps")
        _require(self.fusion_threshold_mb >= 0 or self.fusion_threshold_mb == -1, "horovod.fusion_threshold_mb",
                 self.fusion_threshold_mb, "must be a buffer size in MB, 0 for no fusion, or -1 for the default")
        _require(self.cycle_time_ms >= 0, "horovod.cycle_time_ms", self.cycle_time_ms,
                 "must be a time in milliseconds, e.g. 10, or 0 for the default")
        _require(not (self.use_adasum and self.gradient_predivide_factor != 1.0), "horovod.use_adasum",
                 self.use_adasum, "cannot be combined with gradient_predivide_factor != 1")
        _require(not (self.fp16_allreduce and self.bf16_allreduce), "horovod.bf16_allreduce (--bf16-allreduce)",
                 True, "cannot be combined with --fp16-allreduce: gradients travel in one format; choose one")
        _require(not (self.use_adasum and self.bf16_allreduce), "horovod.bf16_allreduce (--bf16-allreduce)", True,
                 "cannot be combined with --use-adasum: Horovod's Adasum reduces float16, float32 and float64 only; "
                 "leave out one of them")
        _require(self.powersgd_rank >= 0, "horovod.powersgd_rank (--powersgd-rank)", self.powersgd_rank,
                 "must be a rank of 1 or more (1-4 is usual), or 0 for no PowerSGD")
        _require(self.powersgd_start_step >= -1, "horovod.powersgd_start_step (--powersgd-start-step)",
                 self.powersgd_start_step, "must be a number of optimizer steps, or -1 for 10% of the run's steps")
        _require(self.powersgd_min_compression >= 1, "horovod.powersgd_min_compression (--powersgd-min-compression)",
                 self.powersgd_min_compression, "must be a factor of 1 or more, e.g. 2 (DDP's default)")
        if self.powersgd_rank:
            for on, flag, why in ((self.use_adasum, "--use-adasum", "Adasum combines whole updates, not averages"),
                                  (self.shard_optimizer, "--shard-optimizer", "a sharded optimizer reduce-scatters "
                                   "whole gradients"),
                                  (self.elastic, "--elastic", "the residuals are each rank's own and would be lost "
                                   "at a reset"),
                                  (self.gradient_predivide_factor != 1.0, "--horovod.gradient_predivide_factor",
                                   "PowerSGD averages its factors as they are")):
                _require(not on, "horovod.powersgd_rank (--powersgd-rank)", self.powersgd_rank,
                         f"cannot be combined with {flag}: {why}; leave out one of them")
        _require(not (self.use_adasum and self.shard_optimizer), "horovod.shard_optimizer (--shard-optimizer)", True,
                 "cannot be combined with --use-adasum: Adasum combines whole updates, a sharded optimizer steps "
                 "slices of averaged gradients; leave out one of them")


@dataclass
class CheckpointConfig(_Section):
    resume: str = opt("", "checkpoint to resume from: a path, or auto for the newest in <output dir>/checkpoints",
                      flags=("resume",))
    keep_last: int = opt(3, "how many of the newest per-epoch checkpoints to keep (last.pt and best.pt are extra)")
    every_epochs: int = opt(1, "write a checkpoint every this many epochs (and after the last)")
    hist: int = opt(1, "how many of the best checkpoints to keep: best.pt and, from 2, best_epoch_NNNN.pt for each "
                    "of the N best epochs by the task's best metric", flags=("checkpoint-hist",))
    every_steps: int = opt(0, "also write a checkpoint within epochs every this many optimizer steps of the run "
                           "(step_NNNNNNNN.pt, the newest kept; --resume auto continues at the next step); 0: off")
    every_minutes: float = opt(0.0, "also write a checkpoint within epochs at the first step this many minutes after "
                               "the last one (rank 0's clock); 0: off")
    background: bool = opt(True, "write checkpoints from a copy in host memory on a thread of their own while "
                           "training goes on (the step waits only for the copy); false: write them in the step")
    before_time_limit_s: float = opt(300.0, "under SLURM: save and stop (exit 75, which slurm_train.sbatch "
                                     "requeues) this many seconds before the job's time limit; 0: off")

    def __post_init__(self):
        super().__post_init__()
        _require(self.keep_last >= 0, "checkpoint.keep_last", self.keep_last, "must be 0 or more")
        _require(self.every_epochs >= 1, "checkpoint.every_epochs", self.every_epochs, "must be 1 or more")
        _require(self.hist >= 1, "checkpoint.hist (--checkpoint-hist)", self.hist, "must be 1 or more")
        _require(self.every_steps >= 0, "checkpoint.every_steps", self.every_steps,
                 "must be a number of optimizer steps, or 0 for no checkpoints within epochs")
        _require(self.every_minutes >= 0, "checkpoint.every_minutes", self.every_minutes,
                 "must be a number of minutes, or 0 for none")
        _require(self.before_time_limit_s >= 0, "checkpoint.before_time_limit_s", self.before_time_limit_s,
                 "must be a number of seconds, or 0 to ignore the job's time limit")


@dataclass
class LoggingConfig(_Section):
    progress: bool = opt(True, "rank 0 shows its progress through each epoch: a bar (tqdm) on a terminal, under "
                         "any launcher; a whole line every progress_every seconds in a log")
    progress_every: float = opt(60.0, "seconds between progress lines where the output is not a terminal (a log "
                                "file, a pipe); 0: none")
    log_every: int = opt(20, "steps between progress updates and the all-rank non-finite loss check")
    tensorboard: bool = opt(True, "write TensorBoard events to <output dir>/tensorboard")
    plot: bool = opt(True, "draw the loss and accuracy curves to <output dir>/curves.png at the end")
    mlflow: bool = opt(False, "log the run to MLflow from rank 0: a SQLite store in the output directory "
                       "(<output dir>/mlflow.db) unless --mlflow-uri names a tracking server", flags=("mlflow",))
    mlflow_uri: str = opt("", "MLflow tracking URI (http://host:5000, sqlite:///path.db, databricks); implies --mlflow",
                          flags=("mlflow-uri",))
    mlflow_experiment: str = opt("hvd-train", "MLflow experiment the run is logged in (created if missing)")
    wandb: bool = opt(False, "log the run to Weights & Biases offline from rank 0: <output dir>/wandb/offline-run-*, "
                      "uploaded later with `wandb sync` (no network while training)", flags=("wandb",))
    wandb_project: str = opt("hvd-train", "W&B project of the run")
    straggler_pct: float = opt(20.0, "name a rank whose step time without its allreduce wait is more than this many "
                               "percent above the median rank's, with the phase that makes it slow "
                               "(docs/monitoring.md)")
    step_timing: bool = opt(True, "split every step's time into data, compute, allreduce wait, optimizer and other "
                            "on every rank; off only to measure what that costs (make bench)")

    def __post_init__(self):
        super().__post_init__()
        _require(self.log_every >= 1, "logging.log_every", self.log_every, "must be 1 or more steps")
        _require(0 < self.straggler_pct <= 1000, "logging.straggler_pct", self.straggler_pct,
                 "must be a percentage above 0 and at most 1000, e.g. 20 (a rank 20% slower than the median)")
        _require(self.progress_every >= 0, "logging.progress_every", self.progress_every, "must be 0 or more seconds")


@dataclass
class RunConfig(_Section):
    output_dir: str = opt("runs/latest", "where rank 0 writes summary, metrics, checkpoints and the resolved config "
                          "(the command line only: a recipe does not choose it)", flags=("output-dir",))
    seed: int = opt(42, "base random seed: rank r seeds Python's random, NumPy's global generator and torch's (and "
                    "CUDA's) with seed + r in its training process (checkpoints save their states, a resume puts "
                    "them back), and its loader workers' from a base that torch draws from seed + r, plus each "
                    "worker's id (each training sample is drawn seeded by seed, epoch and index); the shuffle and a "
                    "data set factory's draws use the seed itself, shared by the ranks (every rank makes the same "
                    "data); the weights come from rank 0", flags=("seed",))
    evaluate: bool = opt(False, "only evaluate the checkpoint given by --resume, then stop", flags=("evaluate",))
    overwrite: bool = opt(False, "start afresh in an output directory that holds a run, replacing its files (the "
                          "command line only)", flags=("overwrite",))
    device: str = opt("auto", "auto (the GPU local_rank when CUDA sees one, else the CPU), cuda or cpu",
                      flags=("device",), choices=DEVICES)
    name: str = opt("", "name of this configuration in the summary (default: the recipe's file name)")
    stop_at: float = opt(0.0, "stop once an epoch reaches this (98: val top-1 98%; VAE: val loss <= it); 0: off",
                         flags=("stop-at",))
    freeze_timeout_s: float = opt(300.0, "end the job, naming the rank that holds it up, when this rank has waited "
                                  "this many seconds without progress (0: never; fixed-size jobs)",
                                  flags=("freeze-timeout",))
    patience: int = opt(0, "early stopping: end training when the best metric has not improved for this many "
                        "epochs (decided on the global metric, every rank together); 0: off", flags=("patience",))
    divergence_factor: float = opt(100.0, "stop every rank (exit 3) when an epoch's training loss exceeds this many "
                                   "times the run's first-step loss: training that diverged but stayed finite; 0: off")

    def __post_init__(self):
        super().__post_init__()
        _require(bool(self.output_dir), "run.output_dir (--output-dir)", self.output_dir, "must name a directory")
        _require(self.stop_at >= 0, "run.stop_at (--stop-at)", self.stop_at,
                 "must be a target value of the best metric (e.g. 98 for 98% val top-1), or 0 for none")
        _choice("run.device (--device)", self.device, DEVICES)
        _require(self.patience >= 0, "run.patience (--patience)", self.patience, "must be 0 (off) or more epochs")
        _require(self.freeze_timeout_s == 0 or self.freeze_timeout_s >= 10,
                 "run.freeze_timeout_s (--freeze-timeout)", self.freeze_timeout_s,
                 "must be a number of seconds of at least 10 (a step may take seconds), or 0 to never end a job")
        _require(self.divergence_factor == 0 or self.divergence_factor > 1, "run.divergence_factor",
                 self.divergence_factor, "must be above 1 (how many times the first loss means diverged), or 0 for off")


@dataclass
class BenchmarkConfig(_Section):
    enabled: bool = opt(False, "time training steps on one synthetic in-memory batch instead of training",
                        flags=("benchmark",))
    num_warmup_batches: int = opt(10, "untimed steps first: allocator, caches and Horovod's first negotiation settle",
                                  flags=("num-warmup-batches",))
    num_iters: int = opt(10, "timed iterations; images/s is reported as mean +- 1.96 std over them",
                         flags=("num-iters",))
    num_batches_per_iter: int = opt(10, "training steps per timed iteration", flags=("num-batches-per-iter",))

    def __post_init__(self):
        super().__post_init__()
        _require(self.num_warmup_batches >= 0, "benchmark.num_warmup_batches (--num-warmup-batches)",
                 self.num_warmup_batches, "must be 0 or more steps")
        _require(self.num_iters >= 1, "benchmark.num_iters (--num-iters)", self.num_iters,
                 "must be 1 or more timed iterations")
        _require(self.num_batches_per_iter >= 1, "benchmark.num_batches_per_iter (--num-batches-per-iter)",
                 self.num_batches_per_iter, "must be 1 or more steps")


@dataclass
class ProfileConfig(_Section):
    enabled: bool = opt(False, "record a torch.profiler trace and Horovod's timeline of a few training steps into "
                        "<output dir>/profile", flags=("profile",))
    start: int = opt(5, "training steps left out before the profiled ones (warm-up, Horovod's first negotiation, "
                     "torch.compile)", flags=("profile-start",))
    steps: int = opt(3, "training steps profiled", flags=("profile-steps",))
    ranks: str = opt("0", "whose steps torch.profiler records: 0 (rank 0) or all (a trace per rank); Horovod's "
                     "timeline is rank 0's view of every rank", flags=("profile-ranks",), choices=PROFILE_RANKS)

    def __post_init__(self):
        super().__post_init__()
        _require(self.start >= 0, "profile.start (--profile-start)", self.start, "must be 0 or more steps")
        _require(1 <= self.steps <= 1000, "profile.steps (--profile-steps)", self.steps,
                 "must be 1 to 1000 steps (a trace of more is too large to open)")
        _choice("profile.ranks (--profile-ranks)", self.ranks, PROFILE_RANKS)
