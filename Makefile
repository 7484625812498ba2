# Two commands on a fresh machine (only Python 3.10+ needed):
#   make demo   - set up, then run the main job (a federated simulation on digits): FedNAR's
#                 point, co-clipping vs gradient clipping at a too-large weight decay
#   make test   - set up, then run the whole test suite (what CI runs)
#   make test-fast - the development tier: the suite without the tests marked slow
#   make docs  - the documentation site (mkdocs.yml, docs/) into site/, warnings as errors
#   make device-check - on a bare, offline GPU machine whose python3 has torch: no venv, no
#                 download; builds in place for this GPU, then selftest, GPU tests,
#                 compute-sanitizer and benchmarks within 8 minutes, into DEVICE_CHECK_OUT
#                 (default device-check-<date>/; summary.txt first).  Without a GPU: a dry run
#   make gpu-check - the same on a developer's GPU machine, set up as `make setup` does, with
#                 every sanitizer tool, the docs' GPU snippets and full-length benchmarks
#                 (GPU_CHECK_OUT, default gpu-check-<date>/)
# Setup creates .venv, installs torch (the CUDA 13.0 build where available, so the CUDA
# extension compiles; TORCH_SPEC=torch==2.13.0 gives the CPU-only build), then builds
# fedopt_kernels in place with the sim extra (the simulator, its plots, the benchmarks:
# `pip install fedopt_kernels` alone needs torch and numpy), the test extra and the docs
# one.  --no-build-isolation: an isolated build would fetch a second torch to compile
# against.

PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.14.1
MAX_JOBS ?= 2
# pytest-xdist workers (one test file per worker at a time: module fixtures run once),
# given the files in collection order: tests/conftest.py puts the longest first
TEST_JOBS ?= 2
PYTEST_XDIST := -n $(TEST_JOBS) --dist loadfile --no-loadscope-reorder
PY := $(VENV)/bin/python
STAMP := $(VENV)/.fedopt-built
SOURCES := setup.py pyproject.toml $(shell find csrc -type f 2>/dev/null)

.PHONY: setup demo test test-fast docs bench device-check gpu-check clean

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)

$(STAMP): $(VENV)/bin/python $(SOURCES)
	$(PY) -m pip install --quiet "$(TORCH_SPEC)" "setuptools>=64" wheel ninja
	MAX_JOBS=$(MAX_JOBS) $(PY) -m pip install --no-build-isolation --quiet -e ".[sim,test]"
	$(PY) -m pip install --quiet "fedopt_kernels[docs]"   # the docs extra of the package just installed (no rebuild)
	touch $(STAMP)

setup: $(STAMP)

demo: setup
	$(VENV)/bin/fedopt compare --dataset digits --algos fedavg:grad,fedavg:co,scaffold:co,fedadam:co,fedexp:co,asnes:co,fedlaw:co --rounds 40 --weight-decay 0.1 --max-norm 0.5 --out results/digits

test: setup
	$(PY) -m pytest -q $(PYTEST_XDIST)

test-fast: setup
	$(PY) -m pytest -q $(PYTEST_XDIST) -m "not slow"

docs: setup
	$(PY) -m pip install --quiet "fedopt_kernels[docs]"
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict -d site

bench: setup
	$(VENV)/bin/fedopt bench

NOW := $(shell date +%Y%m%d-%H%M%S)
DEVICE_CHECK_OUT ?= device-check-$(NOW)
device-check:
	bash scripts/device-check.sh $(DEVICE_CHECK_OUT)

GPU_CHECK_OUT ?= gpu-check-$(NOW)
gpu-check: setup
	PYTHON=$(PY) DEVICE_CHECK_PROFILE=full DEVICE_CHECK_BUILD=0 bash scripts/device-check.sh $(GPU_CHECK_OUT)

clean:
	rm -rf build *.egg-info fedopt_kernels/*.so
