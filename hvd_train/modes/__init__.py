"""The modes besides a fixed-size training run (train_hvd.train, the recipe): each builds only what it uses.
train_hvd.main decides the mode once."""
