# Two set-up commands: `make serve` and `make test`. Both create .venv when missing.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# torch is pinned to the CPU wheel this machine keeps on disk; installing it first stops
# pip from resolving a multi-GB CUDA build as a dependency of something else.
TORCH := torch==2.13.0
FIND_LINKS := $(if $(wildcard /opt/wheels),--find-links /opt/wheels,)

.PHONY: serve test bench install clean

$(BIN)/python:
	$(PY) -m venv $(VENV) || python3 -m venv $(VENV)

$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet $(FIND_LINKS) $(TORCH)
	$(BIN)/pip install --quiet $(FIND_LINKS) -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

# The gateway on 127.0.0.1:$(PORT) with deploy/default.yaml (both demo engines in-process);
# an embedded redis-server under .tokenyard/redis unless REDIS_URL is set. On the first start it
# prints a development admin API key (once); `tokenyard keys create` makes more.
PORT ?= 8000
serve: $(STAMP)
	@echo "Tokenyard base URL: http://127.0.0.1:$(PORT)/v1"
	$(BIN)/tokenyard serve --config deploy/default.yaml --host 127.0.0.1 --port $(PORT)

test: $(STAMP)
	$(BIN)/python -m pytest tests

bench: $(STAMP)
	$(BIN)/python -m bench.w2_throughput

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
