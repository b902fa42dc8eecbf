# Two commands on a fresh machine (see README):
#   make demo   installs and runs the main job: compare the shipped tiny model on whatever device exists
#   make test   installs and runs the test suite (what CI runs through .ci/run)
PYTHON ?= python3
PIP = $(PYTHON) -m pip

.PHONY: setup demo test test-fast lab

setup:
	@$(PYTHON) -c "import torch" 2>/dev/null || $(PIP) install -q torch==2.13.0
	$(PIP) install -q -r requirements.txt
	$(PIP) install -q --no-deps --no-build-isolation -e .

demo: setup
	mamba-debug compare --report out/report.html --json out/compare.json; test $$? -le 1

test: setup
	$(PYTHON) -m pytest -q

lab: setup
	$(PIP) install -q -r requirements-lab.txt
	mamba-debug lab
