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
# so two workers take ~14 minutes on two cores against ~20 one at a time. The tests that
# assert a wall-clock bound (marker `timing`) then run alone, after the rest: beside a second
# worker their bounds do not hold (docs/testing.md). WORKERS=1 runs everything in one pytest.
WORKERS ?= 2
# $(call pytest,MARKERS): the suite, or the part MARKERS selects, as WORKERS says; with
# workers, both parts run and either failing fails the command
pytest = $(if $(filter 1,$(WORKERS)),$(PY) -m pytest $(if $(1),-m "$(1)"),\
	$(PY) -m pytest -n $(WORKERS) --dist loadfile -m "$(if $(1),($(1)) and )not timing"; \
	parallel=$$?; $(PY) -m pytest -m "$(if $(1),($(1)) and )timing"; \
	alone=$$?; test $$parallel -eq 0 -a $$alone -eq 0)

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
	$(call pytest,)

test-fast: $(STAMP)
	$(call pytest,not slow)

bench: $(STAMP)
	$(PY) -m pip install -q -e '.[bench]'
	$(PY) bench/bench.py

clean:
	rm -rf $(VENV) $(DATA) .pytest_cache .mypy_cache .ruff_cache
