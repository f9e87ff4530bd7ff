# Two commands set everything up: `make train` and `make test`. Both create
# .venv on first use and reinstall the project when its metadata changes.
PYTHON ?= python3
VENV ?= .venv
ARGS ?=
PYTEST_ARGS ?=
# Test files run in this many processes (pytest-xdist; 0: one process).
# Most tests wait on processes, clusters and servers of their own, so two
# fill two cores: the suite takes about a quarter less wall time than in
# one process. A file's tests stay together (module fixtures start once).
# (The short equivalence pass below runs in one: two would start slower
# than they save.)
TEST_PROCS ?= 2
# auto: CuPy with its CUDA libraries for the NVIDIA driver's CUDA version
# (nvidia-smi), none without one; or none, 12, 13. NUMPY: 2 (CuPy 14) or 1
# (NumPy 1.26 and CuPy 13.6, which need a system CUDA toolkit). CUDNN: on
# (cuDNN 9 with the CUDA extra) or off. tools/cuda_extra.py decides, tests
# hold it; docs/install.md says what each brings.
CUDA ?= auto
NUMPY ?= 2
CUDNN ?= on
BIN := $(VENV)/bin

comma := ,
CUDA_ARGS := --numpy $(NUMPY) --cudnn $(CUDNN) $(CUDA)
CUDA_EXTRA := $(shell $(PYTHON) -I tools/cuda_extra.py $(CUDA_ARGS) || echo FAILED)
ifneq ($(findstring FAILED,$(CUDA_EXTRA)),)
$(error CUDA=$(CUDA) NUMPY=$(NUMPY) CUDNN=$(CUDNN): `$(PYTHON) -I tools/cuda_extra.py $(CUDA_ARGS)` failed; CUDA is auto, none, 12 or 13, NUMPY 1 or 2, CUDNN on or off)
endif
EXTRAS := test$(if $(filter none,$(CUDA_EXTRA)),,$(comma)$(CUDA_EXTRA))
# One stamp per choice of extras: choosing others installs again.
STAMP := $(VENV)/.dasktrain-installed-$(subst $(comma),+,$(CUDA_EXTRA))

# ChainerUI 0.11 (the last release) in a venv of its own: it needs
# SQLAlchemy < 1.4 and Flask < 2.3, which the main environment cannot take.
CHAINERUI_VENV ?= .venv-chainerui
CHAINERUI_PORT ?= 5000
RUNS ?= runs

# Honoured by pip's isolated build environments too, which is what chainer's
# sdist needs (its setup.py imports pkg_resources).
export PIP_CONSTRAINT := $(CURDIR)/constraints.txt
export PIP_DISABLE_PIP_VERSION_CHECK := 1

.PHONY: train test lint test-gpu gpu-check notebooks install install-shared browser chainerui chainerui-env clean

install: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	@$(PYTHON) -I tools/cuda_extra.py --explain $(CUDA_ARGS)
	@echo 'make install: $(VENV) with dasktrain[$(EXTRAS)] and its' \
	  'dependencies (Chainer 7.8.1 built from its sdist, Dask, NumPy,' \
	  'Optuna...): a few minutes on a fresh machine, quiet meanwhile'
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet -e '.[$(EXTRAS)]'
	rm -f $(VENV)/.dasktrain-installed*
	touch $(STAMP)

# One install for every user of a lab's machine (run it as root): a venv
# in PREFIX from a Python every user can run (SHARED_PYTHON, default the
# first of PYTHON, /usr/bin/python3 and /usr/local/bin/python3 that every
# user can execute: dasktrain/shared_install.py decides), dasktrain with the
# GPU extras for the driver (CUDA, NUMPY, CUDNN, as for `make install`) and
# the constraints, and BINDIR/dasktrain, on every user's PATH and sudo's.
PREFIX ?= /opt/dasktrain
BINDIR ?= /usr/local/bin
SHARED_PYTHON ?=
SHARED_SPEC := .$(if $(filter none,$(CUDA_EXTRA)),,[$(CUDA_EXTRA)])

install-shared:
	@$(PYTHON) -I tools/cuda_extra.py --explain $(CUDA_ARGS)
	@set -e; umask 022; \
	python=$${SHARED_PYTHON:-$$($(PYTHON) -I dasktrain/shared_install.py python \
	  $(PYTHON) /usr/bin/python3 /usr/local/bin/python3)}; \
	echo "install-shared: a venv in $(PREFIX) from $$python with" \
	  'dasktrain$(if $(filter none,$(CUDA_EXTRA)),,[$(CUDA_EXTRA)]) and' \
	  'its dependencies (a few minutes on a fresh machine), then' \
	  '$(BINDIR)/dasktrain'; \
	test -x $(PREFIX)/bin/python || "$$python" -m venv $(PREFIX); \
	$(PREFIX)/bin/python -m pip install --quiet '$(SHARED_SPEC)'; \
	chmod -R a+rX $(PREFIX); \
	mkdir -p $(BINDIR); ln -sfn $(PREFIX)/bin/dasktrain $(BINDIR)/dasktrain; \
	$(PREFIX)/bin/python -I -m dasktrain.shared_install check; \
	echo 'start the shared queue: sudo $(PREFIX)/bin/dasktrain cluster' \
	  'start --shared (docs/security.md)'

train: $(STAMP)
	$(BIN)/dasktrain train $(ARGS)

# Then the equivalence tests (N replicas vs one device, a stale step vs a
# hand-written one) again under another OpenBLAS kernel: they must prove
# the maths on any CPU, not only on this one's kernel (float64, see
# tests/conftest.py); those marked `processes` (N workers vs one process)
# sum as the in-process replicas do and run once.
# Prescott (SSE3, no FMA) sums in another order than any AVX kernel a
# machine picks by itself; KERNELS="Prescott SandyBridge" adds another.
KERNELS ?= Prescott

test: $(STAMP) browser lint
	$(BIN)/python -m pytest -n $(TEST_PROCS) --dist loadfile $(PYTEST_ARGS)
	@for kernel in $(KERNELS); do \
	  echo "equivalence tests under OPENBLAS_CORETYPE=$$kernel"; \
	  OPENBLAS_CORETYPE=$$kernel $(BIN)/python -m pytest -q \
	    -m 'equivalence and not processes' \
	    -p no:cacheprovider $(PYTEST_ARGS) || exit 1; \
	done

# ruff: lint and import order ([tool.ruff] in pyproject.toml).
lint: $(STAMP)
	$(BIN)/ruff check dasktrain tests bench

# The jobs page's test loads it in a headless Chromium (chromium or
# chromium-browser on PATH); without one that test skips and says why.
# `make test` installs no system package: .ci/run installs Chromium.
browser:
	@command -v chromium >/dev/null 2>&1 || command -v chromium-browser \
	  >/dev/null 2>&1 || echo 'no chromium: the jobs page test will skip' \
	  '(Debian: apt-get install chromium)'

# The GPU suite alone (tests/gpu); each test is skipped, with its reason
# shown, where this machine has no GPU, too few, or no NCCL. `make install`
# picks the GPU extras from the driver (CUDA=12 or CUDA=13 to choose).
test-gpu: $(STAMP)
	$(BIN)/python -m pytest tests/gpu -rs $(PYTEST_ARGS)

# The first thing to run on a GPU machine: the GPU suite, then
# bench/gpu.py, into one report (docs/gpu-check.md) headed by the GPUs,
# driver, CUDA, CuPy, NCCL and cuDNN; under 8 minutes on one GPU, offline
# once installed. GPU_CHECK_ARGS: bench/gpu_check.py --help.
GPU_CHECK_ARGS ?=
gpu-check: $(STAMP)
	$(BIN)/python bench/gpu_check.py $(GPU_CHECK_ARGS)

# Every notebook at its default (full CIFAR-10) size; executed copies and
# their figures go to notebooks/executed/ (ignored by git).
notebooks: $(STAMP)
	$(BIN)/python tools/nbrun.py --out notebooks/executed notebooks/*.ipynb

chainerui-env: $(CHAINERUI_VENV)/.installed

$(CHAINERUI_VENV)/.installed: tools/chainerui-requirements.txt
	test -x $(CHAINERUI_VENV)/bin/python || $(PYTHON) -m venv $(CHAINERUI_VENV)
	$(CHAINERUI_VENV)/bin/python -m pip install --quiet -r tools/chainerui-requirements.txt
	touch $@

# Registers RUNS (a run's --out, or a folder of runs) and serves ChainerUI on
# 127.0.0.1:CHAINERUI_PORT until Ctrl-C. Its database: ~/.chainerui.
chainerui: chainerui-env
	$(CHAINERUI_VENV)/bin/chainerui db create
	$(CHAINERUI_VENV)/bin/chainerui db upgrade
	$(CHAINERUI_VENV)/bin/chainerui project create -d '$(abspath $(RUNS))'
	$(CHAINERUI_VENV)/bin/python tools/serve_chainerui.py server --host 127.0.0.1 --port $(CHAINERUI_PORT)

clean:
	rm -rf $(VENV) $(CHAINERUI_VENV) build *.egg-info
