"""The modes of a run, each building only what it uses: fixed.py (training on a fixed set of ranks), elastic.py,
evaluate.py, benchmark.py. train_hvd.main decides the mode once."""
