# Every target sets itself up on a fresh machine: the venv is created when missing,
# torch (CPU build) goes in first, everything else under a constraint that keeps it.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
BSTAMP  := $(VENV)/.installed-bench
PIP     := $(BIN)/python -m pip
TORCH   := torch==2.13.0
# The MDS writer and reader (format tests, benchmark peer), without its dependencies: it
# requires torchvision, and no torchvision wheel here is built for the CPU torch.
STREAMING := mosaicml-streaming==0.13.0
# torchtitan (its checkpoint manager's seam, make test-stacks) without its dependencies: it
# requires datasets<4.8 (the dev extras need 5.0) and pulls wandb and tensorboard.
TITAN := torchtitan==0.3.0
# A torchvision left by an older set-up (a CUDA build) is removed, then none may remain.
NO_TORCHVISION = $(PIP) uninstall -q -y torchvision 2>/dev/null || true; \
	$(BIN)/python -c "import importlib.util as u, sys; sys.exit(u.find_spec('torchvision') is not None and 'torchvision is installed: it does not load on the CPU torch')"

.PHONY: setup setup-bench setup-prometheus demo demo-cluster test test-stacks test-fast test-chaos test-sim test-compat fuzz lint format bench clean

$(BIN)/python:
	$(PY) -m venv $(VENV)

$(STAMP): $(BIN)/python pyproject.toml constraints.txt
	$(PIP) install -q --upgrade pip
	$(PIP) install -q $(TORCH)
	$(PIP) install -q -c constraints.txt -e '.[dev]'
	$(PIP) install -q -c constraints.txt --no-deps $(STREAMING) $(TITAN)
	$(NO_TORCHVISION)
	touch $@

$(BSTAMP): $(STAMP)
	$(PIP) install -q -c constraints.txt -e '.[dev,bench]'
	$(NO_TORCHVISION)
	touch $@

setup: $(STAMP)

setup-bench: $(BSTAMP)

# A real Prometheus for the daemon's scrape test (Debian's package, ~100 MB); the test
# skips cleanly where it cannot be installed.
setup-prometheus:
	command -v prometheus >/dev/null 2>&1 || \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq prometheus) || \
	  echo "prometheus could not be installed: tests/test_tiering_daemon.py will skip its scrape test"

demo: $(STAMP)
	$(BIN)/python -m fmstore.demo $(DEMO_ARGS)

# The demo plus a second run killed with SIGKILL, its nvme and lustre copies lost (the
# only surviving copy is on S3), resumed and compared bit for bit with the uninterrupted run.
demo-crash: $(STAMP)
	$(BIN)/python -m fmstore.demo --crash --wipe-nvme --lose-lustre $(DEMO_ARGS)

# Two nodes x two ranks (torchrun agents on loopback, each node its own NVMe, state and
# daemon) train the demo's model sharded; one node is killed and replaced mid-run; the job
# resumes and ends bit-identical to an uninterrupted run.
demo-cluster: $(STAMP)
	$(BIN)/python -m fmstore.demo.cluster $(DEMO_ARGS)

# The training stacks' own loops on 2 ranks (tests/test_stack_*.py) run in test-stacks.
test: $(STAMP)
	$(BIN)/python -m pytest -q -p no:cacheprovider --durations=30 --ignore-glob='tests/test_stack_*.py' tests

test-stacks: $(STAMP)
	$(BIN)/python -m pytest -q -p no:cacheprovider --durations=10 tests/test_stack_*.py

test-fast: $(STAMP)
	$(BIN)/python -m pytest -x -q -m "not slow" tests

# The kill schedules at length (make test runs a short schedule of each): the three-node job
# killed at least 20 times, the single-node trainer and daemon killed 10 times, the daemon
# alone killed 24 times.
test-chaos: $(STAMP)
	FMSTORE_CHAOS=1 $(BIN)/python -m pytest -q -p no:cacheprovider -s tests/test_cluster_chaos.py tests/test_tiering_chaos.py \
	  tests/test_tiering_daemon.py::test_kill_9_of_the_daemon_at_random_moments_loses_nothing_long

# The deterministic simulation of exports in node parts (tests/sim_parts.py) at length:
# fresh seeds for SIM_SECONDS (default 600); ends with "schedules: N, violations: V".
test-sim: $(STAMP)
	SIM_SECONDS=$${SIM_SECONDS:-600} PYTHONPATH=tests$${PYTHONPATH:+:$$PYTHONPATH} $(BIN)/python tests/sim_parts.py

# fsspec's own abstract suites (copy, get, put, open, pipe) against fmstore://, every case
# (make test samples their glob edge cases), on a POSIX tier, SeaweedFS and moto's server.
test-compat: $(STAMP)
	FMSTORE_COMPAT=1 $(BIN)/python -m pytest -q -p no:cacheprovider tests/test_fsspec_abstract.py

# The property-based tests of hostile input with a larger budget than `make test` gives them.
fuzz: $(STAMP)
	FMSTORE_FUZZ_EXAMPLES=$${FMSTORE_FUZZ_EXAMPLES:-2000} $(BIN)/python -m pytest -q -p no:cacheprovider -m fuzz tests

lint: $(STAMP)
	$(BIN)/ruff check fmstore tests benchmarks
	$(BIN)/ruff format --check fmstore tests benchmarks
	$(BIN)/mypy fmstore

format: $(STAMP)
	$(BIN)/ruff format fmstore tests benchmarks
	$(BIN)/ruff check --fix fmstore tests benchmarks

bench: $(BSTAMP)
	$(BIN)/python -m benchmarks.run_all

bench-quick: $(BSTAMP)
	$(BIN)/python -m benchmarks.run_all --quick

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache
