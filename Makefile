# persia-kfp: `make help` lists the targets. Targets create .venv on demand from requirements.txt.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
DATA   ?= data/movielens
CONFIG ?= movielens
PS     ?= 0
WORKERS ?= 0
STALENESS ?= -1
EPOCHS ?= 0
MAX_ROWS ?= 0
WARM_START ?=
LR_MARGIN ?= 0
DELTA_EVERY_S ?= 0
DELTA_DIR ?=
PIPELINE_ROOT ?= local_outputs
PYTEST_ARGS ?=
TARGET ?= local
IMAGE ?= persia-kfp:local
CUDA ?=
TORCH_CUDA_INDEX ?= https://download.pytorch.org/whl/cu128
TF_VENV ?= .venv-tfrecord
TORCHREC_VENV ?= .venv-torchrec
TF_PY   := $(TF_VENV)/bin/python
TFRECORD ?=
OUT ?=

# this checkout's code first, for every command and the processes it starts, even where the venv's editable
# install was made from another copy of the repository (a moved checkout, a second clone sharing the venv)
export PYTHONPATH := $(CURDIR)$(if $(PYTHONPATH),:$(PYTHONPATH))
# compiled bytecode and pytest's rewritten test modules are cached in __pycache__ (git-ignored) even where the
# shell sets PYTHONDONTWRITEBYTECODE: without the cache every run recompiles the project and its tests
unexport PYTHONDONTWRITEBYTECODE

.DEFAULT_GOAL := help
.PHONY: help venv run compile test test-fast lint format typecheck clean clean-all image venv-tfrecord test-tfrecord tfrecord tfrecord-args bench-ps bench-ckpt bench-preprocess bench-feed bench-auc bench-quality bench-staleness bench-serve soak device-check venv-torchrec bench

help: ## list the targets
	@grep -E '^[a-zA-Z_-]+:.*?## ' $(MAKEFILE_LIST) | awk 'BEGIN {FS = ":.*?## "}; {printf "  make %-14s %s\n", $$1, $$2}'

$(VENV)/.installed: requirements.txt pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements.txt
	$(PY) -m pip install -q --no-deps -e .
	touch $@

venv: $(VENV)/.installed ## create .venv from requirements.txt and install the project in it

run: venv ## compile the pipeline and run it with kfp.local on DATA with CONFIG (defaults: bundled MovieLens; PS, WORKERS, STALENESS, EPOCHS (a number, or auto: validation-driven), MAX_ROWS override the config; WARM_START: a model or blessed-model location to start from; LR_MARGIN: how far below the LR reference's AUC a blessed model may be; DELTA_EVERY_S, DELTA_DIR: incremental exports for persia serve --deltas)
	$(PY) -m pipelines.persia_pipeline --output pipelines/persia_pipeline.yaml
	PERSIA_DIE_WITH=$$PPID $(PY) -m pipelines.run_local --data "$(DATA)" --config "$(CONFIG)" --pipeline-root $(PIPELINE_ROOT) \
		--parameter-servers $(PS) --nn-workers $(WORKERS) --staleness $(STALENESS) --epochs $(EPOCHS) \
		--max-rows $(MAX_ROWS) --warm-start-from "$(WARM_START)" --lr-margin $(LR_MARGIN) \
		--delta-every-s $(DELTA_EVERY_S) --delta-dir "$(DELTA_DIR)"

compile: venv ## compile the pipeline: TARGET=local (default) -> pipelines/persia_pipeline.yaml; TARGET=vertex (needs PERSIA_BASE_IMAGE) -> pipelines/persia_pipeline_vertex.yaml; TARGET=kubeflow (needs PERSIA_K8S_IMAGE or PERSIA_BASE_IMAGE) -> pipelines/persia_pipeline_kubeflow.yaml
	$(PY) -m pipelines.persia_pipeline --target $(TARGET)

test: venv ## run the whole test suite (2 xdist workers)
	$(PY) -m pytest -q -p no:cacheprovider -n 2 --dist worksteal $(PYTEST_ARGS)

test-fast: venv ## every test that starts no process (servers, DDP ranks, kfp.local tasks, CLIs): under a minute
	PERSIA_TEST_FAST=1 $(PY) -m pytest -q -p no:cacheprovider -m "not processes" -n 2 --dist worksteal $(PYTEST_ARGS)

lint: venv ## ruff: lint (E, F, I, B, UP) and check the format of every Python file
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: venv ## ruff: sort imports and format every Python file in place
	$(VENV)/bin/ruff check --select I --fix .
	$(VENV)/bin/ruff format .

typecheck: venv ## mypy over persia_core, components and pipelines (settings in pyproject.toml)
	$(VENV)/bin/mypy

$(TORCHREC_VENV)/.installed: requirements-torchrec.txt
	test -x $(TORCHREC_VENV)/bin/python || $(PYTHON) -m venv $(TORCHREC_VENV)
	$(TORCHREC_VENV)/bin/python -m pip install -q --upgrade pip
	$(TORCHREC_VENV)/bin/python -m pip install -q --no-deps -r requirements-torchrec.txt
	touch $@

venv-torchrec: $(TORCHREC_VENV)/.installed ## TorchRec 1.8 (CPU) environment for make bench's contestant (d)

bench: venv ## hybrid K=4 vs K=0 vs plain PyTorch vs TorchRec: one JSON line per dataset (BENCH_SAMPLES, BENCH_SEEDS)
	-$(MAKE) venv-torchrec || echo "no TorchRec environment: contestant (d) will be null"
	$(PY) -m persia_core.bench.hybrid

bench-ps: venv ## parameter-server benchmark: lookups/updates per core, gRPC end to end, bytes/row (last line: JSON)
	$(PY) -m persia_core.bench.ps

bench-ckpt: venv ## checkpoint dump/load of a 10M-row shard vs plain sequential I/O (last line: JSON)
	$(PY) -m persia_core.bench.ckpt

bench-preprocess: venv ## Beam preprocess of the bundled MovieLens set: seconds per run, rows (last line: JSON)
	$(PY) -m persia_core.bench.preprocess

soak: venv ## 1.6B parameters (100M+ IDs at dim 16) through the CLI: eviction, a kill and resume, RSS per process vs the plan (last line: JSON; not in make test)
	$(PY) -m persia_core.bench.soak

bench-feed: venv ## CPU us/sample per role feeding 1 NN worker (one-layer dense model) vs plain PyTorch (last line: JSON)
	$(PY) -m persia_core.bench.feed

bench-auc: venv ## MovieLens eval AUC over BENCH_SEEDS seeds (default 3), shipped features and the LR floor's (last line: JSON)
	$(PY) -m persia_core.bench.movielens_auc

bench-quality: venv ## eval AUC/logloss of the shipped models vs the LR reference: MovieLens 10k/30k/all ratings, synthetic Criteo 10k/100k/1M rows, BENCH_SEEDS seeds (one JSON line each)
	$(PY) -m persia_core.bench.quality

bench-serve: venv ## persia serve under open-loop load on 127.0.0.1 (Criteo-shaped DLRM, 1M distinct rows): rows/s of 100-row requests, p50/p99 (last line: JSON)
	$(PY) -m persia_core.bench.serve

bench-staleness: venv ## eval AUC of DCNv2 and DeepFM through the hybrid engine at K=4 vs K=0 on make bench's Criteo-shaped set (BENCH_SAMPLES, BENCH_SEEDS; one JSON line per model)
	$(PY) -m persia_core.bench.staleness_auc

device-check: ## on a CUDA machine, with its own python3 (no .venv): GPU tests + GPU benchmark -> OUT/device_check.json
	python3 -m persia_core.bench.device_check --out "$(or $(OUT),device_outputs)"

image: ## build the project image with Docker: IMAGE=<tag> (default persia-kfp:local), CUDA=1 for the CUDA build
	@command -v docker >/dev/null 2>&1 && docker info >/dev/null 2>&1 || { echo "make image: no working Docker here" \
		"(docker is not installed or its daemon is not running); build with Cloud Build instead:" \
		"gcloud builds submit --config cloudbuild.yaml --substitutions=_REGION=...,_REPOSITORY=..." \
		"(README: Run on Google Cloud)" >&2; exit 1; }
	DOCKER_BUILDKIT=1 docker build -t $(IMAGE) $(if $(CUDA),--build-arg TORCH_INDEX_URL=$(TORCH_CUDA_INDEX),) .

$(TF_VENV)/.installed: requirements-tfrecord.txt pyproject.toml
	test -x $(TF_PY) || $(PYTHON) -m venv $(TF_VENV)
	$(TF_PY) -m pip install -q --upgrade pip
	$(TF_PY) -m pip install -q -r requirements-tfrecord.txt
	$(TF_PY) -m pip install -q --no-deps -e .
	touch $@

venv-tfrecord: $(TF_VENV)/.installed ## create .venv-tfrecord (tensorflow + tensorflow-io, for TFRecord input; ~1.6 GB)

test-tfrecord: venv venv-tfrecord ## run the TFRecord tests in .venv-tfrecord (preprocess runs in .venv)
	PERSIA_TFRECORD_REQUIRED=1 PERSIA_MAIN_PYTHON=$(abspath $(PY)) $(TF_PY) -m pytest -q tests/tfrecord $(PYTEST_ARGS)

tfrecord-args:
	@test -n "$(TFRECORD)" -a -n "$(OUT)" || { echo "make tfrecord: give TFRECORD=<file, glob or folder> and OUT=<folder>" >&2; exit 2; }

# the arguments are checked before the 1.6 GB environment is built
tfrecord: tfrecord-args venv-tfrecord ## TFRecord Examples -> delimited text for preprocess: make tfrecord TFRECORD=<file|glob|folder> OUT=<folder> CONFIG=criteo
	$(TF_PY) -m persia_core.data.tfrecord --input "$(TFRECORD)" --output "$(OUT)" --config "$(CONFIG)"

clean: ## remove run outputs but the blessed models (keeps .venv and $(PIPELINE_ROOT)/blessed, tomorrow's warm start)
	@if [ -d "$(PIPELINE_ROOT)" ]; then find "$(PIPELINE_ROOT)" -mindepth 1 -maxdepth 1 ! -name blessed -exec rm -rf {} +; fi
	rm -rf .pytest_cache

clean-all: ## remove every run output, the blessed models too (keeps .venv)
	rm -rf $(PIPELINE_ROOT) .pytest_cache
