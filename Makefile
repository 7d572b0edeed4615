# make install: .venv/ with openvsan and every test dependency
# make run:     serve examples/single-node.toml (one 1 GiB RAM volume over iSCSI, NVMe/TCP and NBD)
# make test:    the whole suite, as CI runs it (system packages: sudo bash .ci/run, or the apt line in README)
# make test-quick: unit tests only (no sockets, no root, no third-party tools; about a minute)
# make test-integration: in-process servers over loopback and a real etcd (etcd-server), no root
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
DATA_DIR ?= .vsan-data

.PHONY: install run test test-quick test-integration lint clean

# Three steps, so `make run` needs nothing but python3-venv: the project alone; then the unit-test tools;
# then pyfuse3 for the FUSE attach tests, which compiles against libfuse3-dev (installed by .ci/run).
$(VENV)/.run-deps: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e .
	touch $@

$(VENV)/.unit-deps: $(VENV)/.run-deps
	$(BIN)/pip install -q -e '.[test]'
	touch $@

$(VENV)/.test-deps: $(VENV)/.unit-deps
	$(BIN)/pip install -q -e '.[test,fuse]'
	touch $@

install: $(VENV)/.test-deps

run: $(VENV)/.run-deps
	$(BIN)/vsan serve --config examples/single-node.toml --data-dir $(DATA_DIR)

test: $(VENV)/.test-deps
	$(BIN)/python -m pytest tests

test-quick: $(VENV)/.unit-deps
	$(BIN)/python -m pytest tests/unit -q

test-integration: $(VENV)/.unit-deps
	$(BIN)/python -m pytest tests/integration -q

lint: $(VENV)/.unit-deps
	$(BIN)/ruff check src tests
	$(BIN)/mypy

clean:
	rm -rf $(VENV) $(DATA_DIR) .pytest_cache .mypy_cache .ruff_cache
