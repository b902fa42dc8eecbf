# Two commands on a fresh machine (see README):
#   make demo   installs, then runs the main job on the shipped tiny model (writes out/)
#   make test   installs, then runs the whole test suite (what CI runs through .ci/run)
PYTHON ?= python3
PIP = $(PYTHON) -m pip

.PHONY: setup setup-test demo test test-gpu lab bench-cpu compiled-faults

# torch: a CPU machine takes the CPU build on disk (torch==2.13.0); a machine that already has a torch keeps it.
setup:
	@$(PYTHON) -c "import torch" 2>/dev/null || $(PIP) install -q torch==2.13.0
	$(PIP) install -q -r requirements.txt
	$(PIP) install -q --no-deps --no-build-isolation -e .

# the notebook/browser extras, Debian's chromium for the real-browser test, and llama.cpp built once from source
# (llama-cpp-python, ~14 min the first time on 2 cores, then cached in ~/.cache/mamba-debug)
setup-test: setup
	$(PIP) install -q -r requirements-lab.txt
	@command -v chromium >/dev/null || (apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium) \
		|| echo "WARNING: could not install chromium (needs root): tests/test_browser.py will skip"
	PYTHON=$(PYTHON) bash tests/llamacpp/build.sh

# The main job: the correct Triton kernels (no divergence expected), then the #6758 bug (divergence expected).
demo: setup
	mamba-debug compare --json out/compare.json --report out/report.html
	mamba-debug compare --kernels bug_strided_gate --offload 6 --ubatch 8 \
		--json out/bug_strided_gate.json --report out/bug_strided_gate.html; test $$? -eq 1
	@echo "reports: out/report.html out/bug_strided_gate.html"

test: setup-test
	$(PYTHON) -m pytest -q

# On a machine with an NVIDIA GPU and its own torch and triton (no setup: nothing is installed): the kernel tests
# again, compiled for that GPU. CI has no GPU and runs them under Triton's interpreter, and a kernel edit that
# compiles for sm_90 on a CPU can still fail at launch under another Triton version: run this after editing kernels.
GPU_TESTS = tests/test_triton_kernels.py tests/test_triton_mamba2.py tests/test_site_metrics.py tests/test_gallery.py \
	tests/test_token_local.py tests/test_precision_verdict.py tests/test_reference_scans.py
test-gpu:
	MAMBA_DEBUG_TEST_DEVICE=cuda TRITON_INTERPRET=0 $(PYTHON) -m pytest -q $(GPU_TESTS)

lab: setup
	$(PIP) install -q -r requirements-lab.txt
	mamba-debug lab

bench-cpu: setup
	$(PYTHON) benchmarks/engine_cpu.py
	$(PYTHON) benchmarks/dashboard_responsiveness.py

# Seven faults compiled into llama.cpp's CPU build (a second build, ~8 min the first time, cached), each found by
# `mamba-debug compare --engine llama.cpp` through LLAMA_CPP_LIB_PATH where it is born; not part of `make test`
compiled-faults: setup-test
	$(PYTHON) tests/llamacpp/compiled_faults.py
