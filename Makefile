# hvd-train: `make demo` and `make test` set everything up first (scripts/install.sh), then do their job.
VENV ?= .venv
PY := $(VENV)/bin/python
BIN := $(VENV)/bin
NP ?= 2
DEMO_DIR ?= runs/demo
DEMO_ARGS ?=
# The setup stamp is rebuilt when anything the installer reads changes.
READY := $(VENV)/.hvd-train-ready
# The programs the test suite starts besides the app (SLURM, munge): installed once, for make test only.
TEST_TOOLS := $(VENV)/.hvd-train-test-tools

.PHONY: setup demo test test-extended test-builds test-images bench lint clean help

help:
	@echo "make setup   create .venv, install OpenMPI if missing, build Horovod against torch (cached)"
	@echo "make demo    train the small CNN on the digits with $(NP) Horovod ranks, print the summary"
	@echo "make test    run the test suite (real horovodrun and mpirun launches on the CPU; not the builds or images)"
	@echo "make test-extended  the tests make test leaves out for time: scenarios again under other launchers, the bench's quick runs"
	@echo "make test-builds  compile the NCCL build and the offline build against another torch, and train with each"
	@echo "make test-images  build both Docker images and train in and across containers (needs a Docker engine)"
	@echo "make bench   benchmark against bare PyTorch, torchrun DDP and raw allreduce; writes runs/bench/<date>.{json,md}"
	@echo "make lint    flake8, the layering's contracts (import-linter) and the typed seams (mypy)"
	@echo "make clean   remove .venv and runs/ (the cached Horovod wheel in ~/.cache/hvd-train stays)"

setup: $(READY)

$(READY): requirements.txt scripts/install.sh $(filter-out %/__pycache__,$(wildcard scripts/horovod/* scripts/horovod/patches/*)) setup.cfg
	bash scripts/install.sh
	@touch $@

demo: setup
	PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/horovodrun -np $(NP) -H localhost:$(NP) python train_hvd.py --output-dir $(DEMO_DIR) --overwrite $(DEMO_ARGS)
	@$(PY) scripts/show_summary.py $(DEMO_DIR)/summary.json

$(TEST_TOOLS): $(READY)
	bash scripts/install.sh --test-tools
	@touch $@

# Three workers on two cores: most tests wait on launched ranks, and a sleep-bound one (a freeze timeout, SLURM's
# requeue, an elastic reset) leaves the cores to the other two. Two left the cores idle between launches and, with
# one core kept busy by something else, gave that process a larger share (49-52 min in three runs, docs/testing.md).
# Tests that share a cluster, a build or trained runs stay on one worker (xdist_group in the files).
TEST_WORKERS ?= 3

test: setup lint $(TEST_TOOLS)
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadgroup --durations=30

# Tests marked `extended` repeat a scenario make test already runs (under another launcher, with another model) or run
# the bench's sections on their quick settings: about a fifth of the suite's CPU time, left out to bring make test
# toward CI's 45-minute budget on a 2-core machine with a core kept busy (docs/testing.md). Run them before a release or after changing a
# launcher's handling or the bench.
test-extended: setup $(TEST_TOOLS)
	$(PY) -m pytest -m extended -n $(TEST_WORKERS) --dist loadgroup --durations=10

# The Horovod builds beyond the CPU one: minutes of compiling on a new machine (marked `build`, left out of make test
# like the images, so that the suite fits CI's time on a slow 2-core machine).
test-builds: setup
	$(PY) -m pytest -m build tests/cluster/test_builds.py

test-images: setup
	$(PY) -m pytest -m images -s tests/cluster/test_images.py

bench: setup
	$(PY) bench/run.py

# The floor plan as a contract: import-linter's layers and no cycles (setup.cfg [importlinter]), mypy on the annotated
# modules (setup.cfg [mypy]); docs/architecture.md says what each room owns and may import.
lint: setup
	$(PY) -m flake8
	$(PY) scripts/check_layers.py

clean:
	rm -rf $(VENV) runs .pytest_cache
