# make install: .venv/ with openvsan and its test dependencies
# make run:     serve examples/single-node.toml (one 1 GiB RAM volume over iSCSI on 127.0.0.1:3260)
# make test:    the whole suite, as CI runs it (system packages: sudo bash .ci/run, or the apt line in README)
# make test-quick: unit tests only (no root, no third-party tools; seconds)
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
DATA_DIR ?= .vsan-data

.PHONY: install run test test-quick lint clean

$(BIN)/vsan: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test]'
	touch $@

install: $(BIN)/vsan

run: install
	$(BIN)/vsan serve --config examples/single-node.toml --data-dir $(DATA_DIR)

test: install
	$(BIN)/python -m pytest tests

test-quick: install
	$(BIN)/python -m pytest tests/unit -q

lint: install
	$(BIN)/ruff check src tests
	$(BIN)/mypy

clean:
	rm -rf $(VENV) $(DATA_DIR) .pytest_cache .mypy_cache .ruff_cache
