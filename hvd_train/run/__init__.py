"""The output directory of a run and everything in it, one room per concern:

directory   the name of every file and folder a run writes (RunDir), how the directory is claimed, and its lock
            (one job per directory)
checkpoint  checkpoints written and read: saves at epoch ends and within epochs, the stops that save first, and
            finding, reading and resuming them (the one reader of what it writes)
state       what the run has done so far (its history and best metric), and what follows each epoch
reports     what rank 0 logs before training (the arithmetic, who runs where), metrics.jsonl, TensorBoard,
            summary.json and the curves
tracking    MLflow and W&B on rank 0
model_card  what rebuilds and feeds the model outside the app
Every write goes through hvd_train/files.py (atomic, private), which knows no run.
"""
