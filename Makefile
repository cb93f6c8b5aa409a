# VRAM Lab — one command to run the app, one to pass the tests, on a fresh machine.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# torch first, pinned to the CPU build found on this machine's pip index, so that pip never pulls a
# multi-GB CUDA build; a CUDA environment keeps whatever torch it has (the range in pyproject allows it).
TORCH ?= torch==2.13.0
# test processes (pytest-xdist); the suite is CPU-bound simulations and child processes
JOBS ?= 2
PYTEST := $(BIN)/python -m pytest -q -n $(JOBS)
# unsloth's and unsloth_zoo's wheels, unpacked for `make conformance` (tests/test_unsloth_kernels.py, test_unsloth_gc.py)
UNSLOTH_SRC ?= $(VENV)/unsloth-2026.10.9

.PHONY: run test test-slow test-all lint venv clean shots bench package gpu-check conformance conformance-frameworks

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

# Two sessions: the core tests with Qt and pyqtgraph made unimportable (they must pass where Qt is not
# installed), then the GUI tests offscreen. `make test` leaves out the tests marked slow (each over about ten
# seconds on two cores: whole vision-language models traced, the packaged build); `make test-slow` runs only
# those, `make test-all` everything.
CORE_TESTS := VRAMLAB_BLOCK_QT=1 $(PYTEST) -p no:pytest-qt -W ignore::pytest.PytestConfigWarning --ignore=tests/gui
GUI_TESTS := QT_QPA_PLATFORM=offscreen $(PYTEST) tests/gui
test: venv
	$(CORE_TESTS) -m "not slow"
	$(GUI_TESTS) -m "not slow"

test-slow: venv
	$(CORE_TESTS) -m slow
	$(GUI_TESTS) -m slow

test-all: venv
	$(CORE_TESTS)
	$(GUI_TESTS)

lint: venv
	$(BIN)/ruff check .
	$(BIN)/lint-imports

shots: venv
	$(BIN)/python tools/render_views.py shots

bench: venv
	$(BIN)/python benchmarks/run_all.py

# The config readers held to the frameworks' own argument classes and code (core/sources/defaults.py names the
# versions); the frameworks that pin older transformers go in without their dependencies (pure Python, no torch),
# and liger-kernel, whose own Python the Liger loss kernel is held to (its Triton kernels stubbed: they need CUDA).
CONFORMANCE_NODEPS ?= llamafactory==0.9.5 axolotl==0.19.0 ms-swift==4.6.0 liger-kernel==0.8.5 cut-cross-entropy==25.1.1
conformance: venv
	$(BIN)/python -m pip install -q -e ".[conformance]"
	$(BIN)/python -m pip install -q --no-deps $(CONFORMANCE_NODEPS)
	VRAMLAB_BLOCK_QT=1 $(BIN)/python -m pytest -q -p no:pytest-qt -W ignore::pytest.PytestConfigWarning \
		tests/test_framework_defaults.py tests/test_framework_freeze.py tests/test_trl_peft.py \
		tests/test_liger_kernel.py::test_the_reference_allocates_what_liger_allocates \
		tests/test_liger_kernel.py::test_the_tile_is_the_librarys \
		tests/test_liger_kernels.py::test_the_rms_norm_reference_allocates_what_liger_allocates \
		tests/test_liger_kernels.py::test_the_glu_reference_allocates_what_liger_allocates \
		tests/test_liger_kernels.py::test_the_cross_entropy_reference_allocates_what_liger_allocates \
		tests/test_liger_kernels.py::test_the_weight_gradient_buffer_is_one_row_per_sm_on_cuda \
		tests/test_liger_kernels.py::test_transformers_classes_patched_as_liger_patches_them \
		tests/test_cut_cross_entropy.py::test_the_reference_allocates_what_cut_cross_entropy_allocates \
		tests/test_trl_loss.py::test_the_reference_allocates_what_sft_trainer_allocates \
		tests/test_trl_loss.py::test_the_boolean_index_keeps_its_mask_for_backward
	# unsloth imports only with a GPU and triton: its kernels' Python is read from the wheel, not installed
	$(BIN)/python -m pip download -q --no-deps unsloth==2026.10.9 -d $(UNSLOTH_SRC)
	$(BIN)/python -m zipfile -e $(UNSLOTH_SRC)/unsloth-2026.10.9-py3-none-any.whl $(UNSLOTH_SRC)
	$(BIN)/python -m pip download -q --no-deps unsloth_zoo==2026.10.9 -d $(UNSLOTH_SRC)
	$(BIN)/python -m zipfile -e $(UNSLOTH_SRC)/unsloth_zoo-2026.10.9-py3-none-any.whl $(UNSLOTH_SRC)
	# xformers' Python (its kernel dispatch), read from its wheel beside unsloth's: unsloth's attention calls it
	$(BIN)/python -m pip download -q --no-deps xformers==0.0.35 -d $(UNSLOTH_SRC)
	$(BIN)/python -m zipfile -e $(UNSLOTH_SRC)/xformers-0.0.35-*.whl $(UNSLOTH_SRC)
	VRAMLAB_UNSLOTH_SRC=$(UNSLOTH_SRC) VRAMLAB_BLOCK_QT=1 $(BIN)/python -m pytest -q -p no:pytest-qt \
		-W ignore::pytest.PytestConfigWarning tests/test_unsloth_kernels.py tests/test_unsloth_gc.py tests/test_unsloth_rope.py \
		tests/test_unsloth_attention.py tests/test_unsloth_loss.py \
		-k "unsloths_own or unsloths_is or (unsloth_zoos_own and lora_transformers) or unsloth_zoo_allocates \
		or xformers_own"
	$(BIN)/python tools/conformance.py

# The frameworks that pin an older transformers, each run by its own training entry point in a venv of its own
# (.venv-swift, .venv-axolotl, .venv-llamafactory): torch first and held to $(TORCH) by a constraint, then the
# framework with its own pinned dependencies, then this project without its own (the tracker needs torch alone).
# tools/conformance_frameworks.py runs two steps of a tiny model in each and sets the estimate of the same YAML
# beside it: benchmarks/results/conformance_frameworks.json. Minutes, not seconds: not part of CI.
# LLaMA-Factory 0.9.5 needs torchvision and torchaudio, whose builds for torch 2.13 on this index do not import
# over the CPU torch (torchvision's are CUDA builds; torchaudio's newest is 2.11.1): they go again, and the run
# stands in an empty torchaudio for the import its text path never calls.
FRAMEWORK_swift := ms-swift==4.6.0
FRAMEWORK_axolotl := axolotl==0.19.0
FRAMEWORK_llamafactory := llamafactory==0.9.5
.venv-%/.installed:
	$(PY) -m venv .venv-$*
	.venv-$*/bin/python -m pip install -q "$(TORCH)"
	.venv-$*/bin/python -c "import torch; print('torch==' + torch.__version__)" > .venv-$*/torch.txt
	.venv-$*/bin/python -m pip install -q -c .venv-$*/torch.txt "$(FRAMEWORK_$*)"
	if [ "$*" = llamafactory ]; then .venv-$*/bin/python -m pip uninstall -q -y torchvision torchaudio; fi
	.venv-$*/bin/python -m pip install -q --no-deps -e .
	touch $@

conformance-frameworks: venv .venv-swift/.installed .venv-axolotl/.installed .venv-llamafactory/.installed
	$(BIN)/python tools/conformance_frameworks.py

# On a machine with an NVIDIA GPU (and a CUDA build of torch): probes of NVML, the CUDA context, cuBLAS and the
# attention kernels, then real profiles of a small model against their predictions, each step under its own
# timeout, 8 minutes in all; one result file, benchmarks/results/gpu_check.json. It installs nothing and needs no
# network: it runs in this project's venv where one exists, else in the interpreter found ($(PY), e.g. the
# machine's own CUDA torch; a venv with a CPU torch hands over to a python3 on PATH that has a CUDA one). Without
# CUDA it says so and exits 0. bitsandbytes (`pip install -e ".[gpu]"`) adds the
# QLoRA / int8 / 8-bit optimizer steps; without it they are recorded as skipped.
GPU_PY = $(if $(wildcard $(BIN)/python),$(BIN)/python,$(PY))
gpu-check:
	$(GPU_PY) tools/gpu_check.py --no-venv

# The packaged app (packaging/build.py): `make package` (with torch), `make package VARIANT=estimator|all`.
package: venv
	$(BIN)/python -c "import PyInstaller" 2>/dev/null || $(BIN)/python -m pip install -q -e ".[package]"
	$(BIN)/python packaging/build.py --variant $(or $(VARIANT),full)

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache .ruff_cache
