# Every target installs what it needs into .venv first. torch comes from this machine's disk
# (torch==2.13.0, CPU build): it is installed before the package so pip never resolves a newer one.
PY ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-dev

.PHONY: test demo bench bench-quick lint docs clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e ".[dev]"
	touch $(STAMP)

test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q -ra

lint: $(STAMP)
	$(BIN)/ruff check .

# make demo PORT=8060 serves the GUI on another port.
demo: $(STAMP)
	$(BIN)/deepscope demo $(if $(PORT),--port $(PORT))

# Options of benchmarks/run.py (--help) pass through, e.g. make bench BENCH_ARGS="--repeats 5".
bench: $(STAMP)
	$(BIN)/python benchmarks/run.py $(BENCH_ARGS)

bench-quick: $(STAMP)
	$(BIN)/python benchmarks/run.py --quick $(BENCH_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
