# ovkit: the recipe as a readable, runnable pipeline (nanochat's runcpu.sh plays this role there).
#
#   make full-pipeline   set up, then run every stage on the embedded default (synthetic corpus + tiny model, CPU)
#   make test            set up, then run the fast test suite
#
# Every stage is one `ovkit` command reading and writing plain files under $(RUN); re-running skips finished
# stages (each output carries ovkit.json), so an interrupted pipeline continues where it stopped.

PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
OVKIT  := $(BIN)/ovkit
RUN    ?= runs/tiny
SEED   ?= 0
STAMP  := $(VENV)/.ovkit-installed

# torch and torchvision must be a matching pair. These pairs install from the local wheel cache of the CPU
# development machines (DESIGN.md, "Facts verified"); on any other machine pip resolves them normally. GPU users
# who manage torch themselves: `make setup TORCH_PAIR=` skips the pin.
ARCH := $(shell uname -m)
ifeq ($(ARCH),aarch64)
TORCH_PAIR ?= torch==2.9.1 torchvision==0.24.1
else
TORCH_PAIR ?= torch==2.14.1 torchvision==0.29.1
endif

.PHONY: setup test test-slow full-pipeline clean-run bench help

help:
	@sed -n '2,7p' Makefile

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@if [ -n "$(TORCH_PAIR)" ] && ! $(BIN)/python -c "import torch, torchvision" 2>/dev/null; then \
		echo "installing $(TORCH_PAIR)"; $(BIN)/pip install -q $(TORCH_PAIR); fi
	$(BIN)/pip install -q -e '.[dev]'
	touch $(STAMP)

test: setup
	$(BIN)/python -m pytest

test-slow: setup
	$(BIN)/python -m pytest -m slow

bench: setup
	$(BIN)/pip install -q -e '.[dev,bench]'
	$(BIN)/python bench/pack.py
	$(BIN)/python bench/rewards.py

clean-run:
	rm -rf $(RUN)

# ---------------------------------------------------------------------------------------------------------------
# The pipeline on the embedded default.

# 1. The synthetic corpus: pretrain captions (en/zh), instructions, RL prompts and held-out eval sets, concepts.
$(RUN)/data/ovkit.json: | setup
	$(OVKIT) synth --out $(RUN)/data --seed $(SEED)

# 2. The stage-0 model: a tiny Qwen2.5-VL-architecture VLM and a tokenizer trained on the corpus text.
$(RUN)/models/stage0/ovkit.json: $(RUN)/data/ovkit.json
	$(OVKIT) init-model --preset tiny --corpus $(RUN)/data --out $(RUN)/models/stage0 --seed $(SEED)

full-pipeline: setup $(RUN)/models/stage0/ovkit.json
	@echo "pipeline finished: outputs under $(RUN)"
