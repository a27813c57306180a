"""hvd-train: the application around Horovod's data-parallel recipe (train_hvd.py is the entry point).

config      the one typed configuration (defaults < YAML recipe < command line)
build       the parts a mode needs: checks, data, model, optimizer, learning-rate schedule, the Trainer
engine      a step, an epoch, validation, and the one training loop (fit) that every mode drives through hooks
schedule    the one learning-rate mechanism: the rate as a function of progress in (fractional) epochs
run_state   what a run has done so far (epochs, steps, history, best metric) and what follows each epoch
run_dir     every file a run writes, claiming the directory, and the one atomic writer
checkpoint  one save and one load
reporting   metrics.jsonl, TensorBoard, the curves, the setup lines and summary.json
modes/      elastic, evaluate, benchmark (the fixed-size training run is in train_hvd.py)
Horovod itself is used only through hvd_utils.
"""
