# make train ARGS="..." | make test | make test-fast | make lint | make demo | make bench | make bench-cpu | make recipes
# | make tensorboard | make gpu-check | make profile | make lock | make audit
# Each target creates .venv and installs the project into it on first use, from requirements.lock with pip checking
# every file's hash; but gpu-check and profile: they run with the torch at hand (a GPU node's own), the venv's
# python if there is one, else $(PYTHON); they never pip.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# Every package and version the test suite passed with, each with its files' sha256 (pip-compile --generate-hashes),
# for CPython 3.11 on x86-64 Linux; make lock writes it again. The tools that write and audit it live in a venv of
# their own, locked the same way.
LOCK ?= requirements.lock
TOOLS ?= .venv-tools
TOOLS_LOCK ?= requirements-tools.lock
ARGS ?=
PYTEST_ARGS ?=

# gpu-check and profile: GPU_CHECK_PYTHON=python3.12 make gpu-check picks another interpreter
GPU_CHECK_PYTHON ?= $(if $(wildcard $(PY)),$(PY),$(PYTHON))

.PHONY: install lock audit train test test-fast lint demo eval tensorboard bench bench-cpu recipes scale gpu-check profile clean

install: $(VENV)/.installed

## the locked set, hash-checked (a file whose hash differs from the lock's stops the install); then the project
## itself, which has no hash: editable, without dependencies and without a build env of its own (the lock's setuptools)
$(VENV)/.installed: pyproject.toml $(LOCK)
	@$(PYTHON) -c "$$CHECK_LOCK_PLATFORM" $(LOCK)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --require-hashes -r $(LOCK)
	$(PY) -m pip install --quiet --no-deps --no-build-isolation -e .
	@echo "installed from $(LOCK): $$(grep -c '^[a-z0-9]' $(LOCK)) packages, every file pip fetched checked" \
	    "against its sha256"
	touch $@

# One error line, not a failed download, where the lock cannot hold: another Python or platform.
define CHECK_LOCK_PLATFORM
import platform, re, sys
lock = open(sys.argv[1]).read()
want = re.search(r"with Python (\S+)", lock).group(1), re.search(r"# for: (\S+)", lock).group(1)
have = "%d.%d" % sys.version_info[:2], f"{platform.system()}-{platform.machine()}"
if want != have:
    print(f"error: {sys.argv[1]} is for Python {want[0]} on {want[1]}, but $(PYTHON) is Python {have[0]} on "
          f"{have[1]}: run make lock to lock for this machine, PYTHON=python{want[0]} make ..., or "
          "pip install -e '.[dev]' in an environment of your own", file=sys.stderr)
    sys.exit(2)
endef
export CHECK_LOCK_PLATFORM

$(TOOLS)/.installed: $(TOOLS_LOCK)
	test -x $(TOOLS)/bin/python || $(PYTHON) -m venv $(TOOLS)
	$(TOOLS)/bin/python -m pip install --quiet --require-hashes -r $(TOOLS_LOCK)
	touch $@

## write requirements.lock again from pyproject.toml: the newest versions its ranges admit, with every file's hash
## (then make test, make audit, and commit the lock with the code it passed with). LOCK_ARGS="--upgrade-package X"
## moves one package only; the default moves everything.
LOCK_ARGS ?= --upgrade
# the index this machine's pip is set up with stays out of the lock: the hashes are what a file must match
COMPILE = CUSTOM_COMPILE_COMMAND="make lock" $(TOOLS)/bin/pip-compile --quiet --generate-hashes --allow-unsafe \
    --strip-extras --no-emit-index-url --no-emit-find-links --no-emit-trusted-host $(LOCK_ARGS)
lock: $(TOOLS)/.installed
	$(COMPILE) --output-file $(TOOLS_LOCK) requirements-tools.in
	$(COMPILE) --extra dev --output-file $(LOCK) pyproject.toml
	@# the project names itself in its dev extra: its own line (a path, no hash) goes; make install adds it
	awk '/^# WARNING: pip install will require/ {skip = 1} skip && /^[a-z0-9]/ && !/^cifar10-ddp @/ {skip = 0} \
	    !skip' $(LOCK) > $(LOCK).tmp && mv $(LOCK).tmp $(LOCK)
	sed -i "s|^# by the following command:|# for: $$(uname -s)-$$(uname -m)\n&|" $(LOCK)
	@echo "$(LOCK): $$(grep -c '^[a-z0-9]' $(LOCK)) packages; now make test and make audit"

## the locked set against the advisories the package index publishes (pip-audit): each finding with the version
## that fixes it, exit 1 on any; exit 2 when the advisory service cannot be reached (nothing was audited)
AUDIT_SERVICE ?= pypi
audit:
	@$(PYTHON) -c "$$CHECK_ADVISORIES_REACHABLE" $(AUDIT_SERVICE) $(LOCK)
	@$(MAKE) --no-print-directory $(TOOLS)/.installed
	$(TOOLS)/bin/pip-audit --strict --require-hashes --disable-pip --progress-spinner off \
	    --vulnerability-service $(AUDIT_SERVICE) --desc off -r $(LOCK)

# pip-audit reports a package the service does not know as skipped, and a service it cannot reach as a traceback:
# ask the service about the lock's first package first, and say in one line when it cannot answer.
define CHECK_ADVISORIES_REACHABLE
import json, re, sys, urllib.error, urllib.request
service, lock = sys.argv[1:]
name, version = re.search(r"^([a-z0-9_.-]+)==(\S+)", open(lock).read(), re.M).groups()
url, data = {"pypi": (f"https://pypi.org/pypi/{name}/{version}/json", None),
             "osv": ("https://api.osv.dev/v1/query", json.dumps({"package": {"name": name, "ecosystem": "PyPI"},
                                                                "version": version}).encode())}[service]
try:
    urllib.request.urlopen(urllib.request.Request(url, data=data), timeout=30).read()
except (urllib.error.URLError, OSError) as err:
    print(f"error: make audit cannot read the advisory data of {service} ({url}: {getattr(err, 'reason', err)}): "
          "nothing was audited; run it where that service answers, or pick another with AUDIT_SERVICE=pypi|osv",
          file=sys.stderr)
    sys.exit(2)
endef
export CHECK_ADVISORIES_REACHABLE

## the real job: ResNet-50 on CIFAR-10 (downloaded once into data/), all local GPUs or the CPU
train: install
	$(PY) -m src.train $(ARGS)

## the test suite (CPU, gloo, a local Slurm cluster where the tests need one)
## everything, on every core (pytest-xdist; a test file's tests on one worker, in order; TEST_WORKERS=0: one process)
TEST_WORKERS ?= auto
XDIST = -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder
test: install
	$(PY) -m pytest $(XDIST) $(PYTEST_ARGS)

## the inner loop, in at most 2 minutes: the tests of at most a second (tests/durations.json) and one smoke run, on
## every core as make test (TEST_WORKERS=0: one process)
test-fast: install
	$(PY) -m pytest $(XDIST) -m fast $(PYTEST_ARGS)

## ruff's lint and format check, and mypy on the packages typed throughout (pyproject.toml says which and why);
## the suite runs the same (tests/test_lint.py). make lint FIX=1 lets ruff fix and format what it can.
LINTED := src tests benchmarks hydra_plugins
FIX ?=
lint: install
	@if [ -n "$(FIX)" ]; then $(VENV)/bin/ruff check --fix $(LINTED); $(VENV)/bin/ruff format $(LINTED); fi
	$(VENV)/bin/ruff check $(LINTED)
	$(VENV)/bin/ruff format --check $(LINTED)
	$(VENV)/bin/mypy

## a short offline tour: synthetic data, two CPU processes with gloo, checkpoint, TensorBoard logs, eval
## (src.eval re-tests the checkpoint the training tested, on the run's data: the same accuracy, from the run's files)
DEMO_DIR ?= outputs/demo
DEMO_ARGS ?=
demo: install
	rm -rf $(DEMO_DIR)
	$(PY) -m src.train experiment=demo hydra.run.dir=$(DEMO_DIR)/train $(DEMO_ARGS)
	$(PY) -m src.eval trainer.accelerator=cpu \
	    ckpt_path=$$(ls $(DEMO_DIR)/train/checkpoints/best-*.ckpt) hydra.run.dir=$(DEMO_DIR)/eval
	@echo
	@echo "demo outputs:"
	@echo "  resolved config    $(DEMO_DIR)/train/config.yaml"
	@echo "  checkpoints        $$(ls $(DEMO_DIR)/train/checkpoints/*.ckpt | tr '\n' ' ')"
	@echo "  TensorBoard logs   $(DEMO_DIR)/train/tensorboard/   (make tensorboard, then http://127.0.0.1:6006)"
	@echo "  per-process logs   $$(ls $(DEMO_DIR)/train/*.log | tr '\n' ' ')"
	@echo "  test metrics       $(DEMO_DIR)/eval/test_metrics.json"

## evaluate a checkpoint: make eval CKPT=outputs/runs/.../checkpoints/last.ckpt
eval: install
	$(PY) -m src.eval ckpt_path=$(CKPT) $(ARGS)

## TensorBoard over every run, on 127.0.0.1 only (reach it from elsewhere through an SSH tunnel)
TB_PORT ?= 6006
tensorboard: install
	$(VENV)/bin/tensorboard --logdir outputs --host 127.0.0.1 --port $(TB_PORT)

## the project against a bare torch.distributed loop at equal settings: model, batch, data path, DDP, number format,
## compile (~10 min on 2 cores)
BENCH_ARGS ?=
bench: install
	$(PY) benchmarks/bench.py $(BENCH_ARGS)

## the first run on a new GPU node (offline, at most 10 min): GPU tests, throughput table, nccl / determinism /
## resume / eval / one-GPU-per-rank checks -> outputs/gpu-check/report.md and report.json
## (GPU_CHECK_ARGS="--only throughput,bench", "--skip tests", "--budget-s 900"; GPU_CHECK_DEVICE=cpu: its CPU mode)
GPU_CHECK_ARGS ?=
gpu-check:
	$(GPU_CHECK_PYTHON) benchmarks/gpu_check.py $(GPU_CHECK_ARGS)

## a torch.profiler summary of steady-state steps, the project against the bare loop at equal settings
## (PROFILE_ARGS="--batch-size 512 --pipeline dataloader --compile") -> outputs/profile/profile.md and profile.json
PROFILE_ARGS ?=
profile:
	$(GPU_CHECK_PYTHON) benchmarks/profile_step.py $(PROFILE_ARGS)

## the control plane (failure record, hang watch) of 16 to 2,048 simulated ranks against one real store: the host's
## requests, bytes, CPU, sockets and latency, a stuck and a dead rank, projected to 16,384 (~9 min on 2 cores)
## (SCALE_ARGS="--ranks 16,64 --healthy-s 600") -> outputs/bench/control-plane/table.md, results.json, load.svg
SCALE_ARGS ?=
scale: install
	$(PY) benchmarks/control_plane.py $(SCALE_ARGS)

## the CPU fast path: the project's rate in fp32/bf16 x contiguous/channels-last and with its defaults (~10 min on 2 cores)
BENCH_CPU_ARGS ?=
bench-cpu: install
	$(PY) benchmarks/cpu_fast_path.py $(BENCH_CPU_ARGS)

## the default recipe against the seed-004 recipe (plain SGD, lr 1e-4), same net/data/epochs: test accuracies
## (RECIPE_ARGS="--compare precision ..." compares fp32 with bf16 instead)
RECIPE_ARGS ?= --epochs 10 --arch resnet50
recipes: install
	$(PY) benchmarks/compare_recipes.py $(RECIPE_ARGS)

clean:
	rm -rf outputs/runs outputs/multirun .pytest_cache
