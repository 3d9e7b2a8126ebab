# The two set-up commands of the README: `make serve` and `make test`.
VENV   ?= .venv
PY     := $(VENV)/bin/python
BIN    := $(abspath $(VENV))/bin
# the service's install (the `server` extra: no torch, no dev tools) ...
SERVE_STAMP := $(VENV)/.serve-stamp
# ... and everything: torch, the backends' drivers, the dev and test tools
STAMP  := $(VENV)/.installed-stamp
HOST   ?= 127.0.0.1
PORT   ?= 8000
DATA   ?= ./ckptstore-data
# pytest workers (pytest-xdist): most tests wait on a child service, a database or a socket,
# so WORKERS=2 takes ~14 minutes on two cores against ~20; but a timing test failed once in
# five such runs (an S3 deadline test, its bound overrun under the other worker's load), so
# the default stays one test at a time (docs/testing.md)
WORKERS ?= 1
XDIST  := $(if $(filter-out 1,$(WORKERS)),-n $(WORKERS) --dist worksteal)

.PHONY: setup serve test test-fast lint bench clean

$(SERVE_STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[server]'
	touch $(SERVE_STAMP)

# torch is installed first, pinned: an unpinned torch (pulled by Lightning, transformers)
# brings gigabytes of CUDA packages.
$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[server,s3,postgres,dev]'
	touch $(STAMP) $(SERVE_STAMP)

setup: $(STAMP)

serve: $(SERVE_STAMP)
	@echo "ckptstore and ckptstore-service are in $(BIN) (export PATH=\"$(BIN):\$$PATH\")"
	@echo "tokens (required when HOST is not loopback): CKPTSTORE_DATA_DIR=$(DATA) $(BIN)/ckptstore-service token create NAME --scope admin --runs '*'"
	$(VENV)/bin/ckptstore-service serve --host $(HOST) --port $(PORT) --data-dir $(DATA)

lint: $(STAMP)
	$(VENV)/bin/ruff check core client service tests bench
	$(VENV)/bin/ruff format --check core client service tests bench
	$(VENV)/bin/mypy core/ckptstore_core client/ckptstore service/ckptstore_service

test: lint
	$(PY) -m pytest $(XDIST)

test-fast: $(STAMP)
	$(PY) -m pytest $(XDIST) -m "not slow"

bench: $(STAMP)
	$(PY) -m pip install -q -e '.[bench]'
	$(PY) bench/bench.py

clean:
	rm -rf $(VENV) $(DATA) .pytest_cache .mypy_cache .ruff_cache
