# VRAM Lab — one command to run the app, one to pass the tests, on a fresh machine.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# torch first, pinned to the CPU build found on this machine's pip index, so that pip never pulls a
# multi-GB CUDA build; a CUDA environment keeps whatever torch it has (the range in pyproject allows it).
TORCH ?= torch==2.13.0

.PHONY: run test lint venv clean shots bench package

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

$(VENV)/.installed: $(BIN)/python pyproject.toml
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q "$(TORCH)"
	$(BIN)/python -m pip install -q -e ".[dev,hf,package]"
	touch $@

venv: $(VENV)/.installed

run: venv
	$(BIN)/vramlab

test: venv
	QT_QPA_PLATFORM=offscreen $(BIN)/python -m pytest -q

lint: venv
	$(BIN)/ruff check .

shots: venv
	$(BIN)/python tools/render_views.py shots

bench: venv
	$(BIN)/python benchmarks/run_all.py

# The packaged app (packaging/build.py): `make package` (with torch), `make package VARIANT=estimator|all`.
package: venv
	$(BIN)/python -c "import PyInstaller" 2>/dev/null || $(BIN)/python -m pip install -q -e ".[package]"
	$(BIN)/python packaging/build.py --variant $(or $(VARIANT),full)

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache .ruff_cache
