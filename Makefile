# memspec_ros developer entry points (this Debian 12 / Python 3.11 machine, ROS 2 from PyPI wheels).
#   make setup   .venv + ROS 2 Jazzy wheels + Python libraries + colcon build + .venv-gptq (idempotent, fast when unchanged)
#   make build   every step of setup except .venv-gptq; FORCE=1 redoes the colcon build even when nothing changed
#   make deps    only .venv, the ROS 2 wheels and the Python libraries (FORCE=1 reinstalls them)
#   make gptq    only .venv-gptq, GPT-QModel's side environment (MEMSPEC_GPTQ=0 skips it here and in make test)
#   make lint    ruff over the whole tree
#   make test    setup if needed (.venv-gptq too), build, lint, then the whole pytest suite (PYTEST_ARGS=...)
#   make clean   remove build/ install/ log/      make distclean   ... and .venv, .venv-gptq
#   make demo    the node on the bundled zoo: configure, activate, a streamed goal and its follow-up turn, /diagnostics, clean stop (DEMO_ARGS=...)
#   make bench   the paper's evaluation (figures 6-12, table 2, storage media, goals) into docs/results/ (2-15 min at the default 2 prompts per workload; 18-46 min at 24, by host; BENCH_ARGS=...)
SHELL := /bin/bash
.SHELLFLAGS := -eo pipefail -c
.DEFAULT_GOAL := help

FORCE ?=
SETUP := scripts/setup.sh
SETUP_FLAGS := $(if $(FORCE),--force,)
# pytest's own exit codes pass through: 5 ("no tests collected") fails the target like any other.
PYTEST_ARGS ?=

.PHONY: help setup deps build gptq lint test demo bench clean distclean

help:
	@sed -n '2,10p' Makefile | sed 's/^# \{0,1\}//'

setup:
	$(SETUP) all $(SETUP_FLAGS)

deps:
	$(SETUP) deps $(SETUP_FLAGS)

build:
	$(SETUP) build $(SETUP_FLAGS)

# The GPT-QModel side environment .venv-gptq (test/test_gptq.py); MEMSPEC_GPTQ=0 skips it.
gptq:
	@if [ "$${MEMSPEC_GPTQ:-1}" != 0 ]; then $(SETUP) gptq; else echo "[setup] MEMSPEC_GPTQ=0: no .venv-gptq"; fi

RUFF := .venv/bin/ruff check .

lint: deps
	$(RUFF)

# One recipe, so that the steps run in this order even under make -j.
test: build gptq
	$(RUFF)
	source ./env.sh && MEMSPEC_TEST_STRICT=1 MEMSPEC_REQUIRE_GPTQ=$${MEMSPEC_GPTQ:-1} python -m pytest $(PYTEST_ARGS)

# The node as its own process on the bundled zoo (models/), driven through the lifecycle services
# and the Generate action; non-zero exit if any step fails. DEMO_ARGS: e.g. --max-new-tokens 64.
DEMO_ARGS ?=
demo: build
	source ./env.sh && python -m memspec_ros.ros.demo $(DEMO_ARGS)

# The paper's evaluation (issue 17): one timed policy bench on the bundled zoo (real runs: figures 6-9, the goals)
# and the trace-driven simulator validated against it (figures 10-12, the storage media); every item as JSON + PNG
# in docs/results/ and the generated part of docs/results/README.md. BENCH_ARGS: e.g. --prompts 1 --storage sd;
# --render-only (spelled out) redraws the page from the items already there (BENCH_PATHS, options of a run, are left
# out then).
# The target and the drafts run on the int4 path (the engine's CPU kernels where this CPU has them), as a robot would.
BENCH_PATHS ?= --quantization int4 --draft-quantization int4
BENCH_ARGS ?=
bench: build
	source ./env.sh && time nice -n 5 python -m memspec_ros.bench.cli paper \
	  $(if $(findstring --render-only,$(BENCH_ARGS)),,$(BENCH_PATHS)) $(BENCH_ARGS)

clean:
	rm -rf build install log

distclean: clean
	rm -rf .venv .venv-gptq
