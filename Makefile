# make train ARGS="..." | make test | make demo | make bench | make bench-cpu | make recipes | make tensorboard
# | make gpu-check | make profile
# Each target creates .venv and installs the project into it on first use, but gpu-check and profile: they run
# with the torch at hand (a GPU node's own), the venv's python if there is one, else $(PYTHON); they never pip.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The torch pair this project is tested with (on this kind of machine pip takes them from local disk).
TORCH_PINS ?= torch==2.14.1 torchvision==0.29.1
ARGS ?=
PYTEST_ARGS ?=

# gpu-check and profile: GPU_CHECK_PYTHON=python3.12 make gpu-check picks another interpreter
GPU_CHECK_PYTHON ?= $(if $(wildcard $(PY)),$(PY),$(PYTHON))

.PHONY: install train test demo eval tensorboard bench bench-cpu recipes gpu-check profile clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet $(TORCH_PINS)
	$(PY) -m pip install --quiet -e ".[dev]"
	touch $@

## the real job: ResNet-50 on CIFAR-10 (downloaded once into data/), all local GPUs or the CPU
train: install
	$(PY) -m src.train $(ARGS)

## the test suite (CPU, gloo, a local Slurm cluster where the tests need one)
test: install
	$(PY) -m pytest $(PYTEST_ARGS)

## a short offline tour: synthetic data, two CPU processes with gloo, checkpoint, TensorBoard logs, eval
## (src.eval re-tests the checkpoint the training tested, on the same images: the same accuracy, from the file alone)
DEMO_DIR ?= outputs/demo
DEMO_ARGS ?=
demo: install
	rm -rf $(DEMO_DIR)
	$(PY) -m src.train experiment=demo hydra.run.dir=$(DEMO_DIR)/train $(DEMO_ARGS)
	$(PY) -m src.eval data=synthetic data.num_test=256 trainer.accelerator=cpu \
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
