"""The output directory of a run and everything in it: claiming it (directory, lock), checkpoints, the run's
state and what follows each epoch, reports, trackers, the model card. Every file name in it is spelled in
directory.py."""
