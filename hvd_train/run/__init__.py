"""The output directory of a run and everything in it, one room per concern:

directory   the name of every file and folder a run writes (RunDir), and how the directory is claimed
lock        one job per directory
checkpoint  writing checkpoints; saves: those within epochs, and the stops that save first
resume      finding, reading and resuming checkpoints: the one reader of what checkpoint writes
state       what the run has done so far, and what follows each epoch
best        metrics from a task's sums, and comparisons with the best
setup_lines what rank 0 logs before training (the arithmetic, who runs where)
reporting   metrics.jsonl, TensorBoard, summary.json and the curves
tracking    MLflow and W&B on rank 0
model_card  what rebuilds and feeds the model outside the app
Every write goes through hvd_train/files.py (atomic, private), which knows no run.
"""
