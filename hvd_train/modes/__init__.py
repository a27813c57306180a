"""The modes besides a fixed-size training run (train_hvd.train): each builds only what it uses."""
