# Two commands for a newcomer: `make demo` and `make test`. Both set up ./.venv first.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: install demo test bench fuzz clean

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

# Mutation fuzzing of every parser of untrusted input (12,000 cases, a few minutes); fails on any unhandled exception.
fuzz: install
	$(BIN)/python -m benchmarks.fuzz --cases 12000

clean:
	rm -rf dsconv-demo .pytest_cache build *.egg-info
