"""The modes that differ from training on a fixed set of ranks (train_hvd.py's recipe): elastic.py (the same parts
inside Horovod's elastic loop), evaluate.py and benchmark.py (they measure, and train nothing). train_hvd.main
decides the mode once."""
