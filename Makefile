# persia-kfp: `make help` lists the targets. Targets create .venv on demand from requirements.txt.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
DATA   ?= data/movielens
CONFIG ?= movielens
PS     ?= 2
WORKERS ?= 2
STALENESS ?= -1
EPOCHS ?= 0
MAX_ROWS ?= 0
PIPELINE_ROOT ?= local_outputs
PYTEST_ARGS ?=

.DEFAULT_GOAL := help
.PHONY: help venv run compile test clean

help: ## list the targets
	@grep -E '^[a-zA-Z_-]+:.*?## ' $(MAKEFILE_LIST) | awk 'BEGIN {FS = ":.*?## "}; {printf "  make %-12s %s\n", $$1, $$2}'

$(VENV)/.installed: requirements.txt pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements.txt
	$(PY) -m pip install -q --no-deps -e .
	touch $@

venv: $(VENV)/.installed ## create .venv from requirements.txt and install the project in it

run: venv ## compile the pipeline and run it with kfp.local on DATA with CONFIG (defaults: bundled MovieLens)
	$(PY) -m pipelines.persia_pipeline --output pipelines/persia_pipeline.yaml
	$(PY) -m pipelines.run_local --data "$(DATA)" --config "$(CONFIG)" --pipeline-root $(PIPELINE_ROOT) \
		--parameter-servers $(PS) --nn-workers $(WORKERS) --staleness $(STALENESS) --epochs $(EPOCHS) \
		--max-rows $(MAX_ROWS)

compile: venv ## compile the pipeline to pipelines/persia_pipeline.yaml
	$(PY) -m pipelines.persia_pipeline --output pipelines/persia_pipeline.yaml

test: venv ## run the whole test suite
	$(PY) -m pytest -q $(PYTEST_ARGS)

clean: ## remove run outputs (keeps .venv)
	rm -rf $(PIPELINE_ROOT) .pytest_cache
