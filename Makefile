# Two commands for a newcomer: `make demo` and `make test`. Both set up ./.venv first.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: install demo test bench clean

install: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -c constraints.txt -e '.[dev]'
	touch $(STAMP)

demo: install
	$(BIN)/dsconv demo dsconv-demo --force

test: install
	$(BIN)/python -m pytest -q

bench: install
	$(BIN)/python -m benchmarks

clean:
	rm -rf dsconv-demo .pytest_cache build *.egg-info
