# Two commands set everything up: `make train` and `make test`. Both create
# .venv on first use and reinstall the project when its metadata changes.
PYTHON ?= python3
VENV ?= .venv
ARGS ?=
PYTEST_ARGS ?=
BIN := $(VENV)/bin
STAMP := $(VENV)/.dasktrain-installed

# Honoured by pip's isolated build environments too, which is what chainer's
# sdist needs (its setup.py imports pkg_resources).
export PIP_CONSTRAINT := $(CURDIR)/constraints.txt
export PIP_DISABLE_PIP_VERSION_CHECK := 1

.PHONY: train test test-gpu notebooks install browser clean

install: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet -e '.[test]'
	touch $(STAMP)

train: $(STAMP)
	$(BIN)/dasktrain train $(ARGS)

test: $(STAMP) browser
	$(BIN)/python -m pytest $(PYTEST_ARGS)

# The jobs page's test loads it in a headless Chromium. Where none is found
# and this runs as root with apt-get (CI's machines), Debian's chromium is
# installed; elsewhere that one test skips and says why.
browser:
	@command -v chromium >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && \
	  command -v apt-get >/dev/null 2>&1 && \
	  echo 'installing chromium (apt-get) for the jobs page test' && \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get \
	  install -y -qq --no-install-recommends chromium >/dev/null; } || \
	  echo 'no chromium: the jobs page test will skip (apt-get install chromium)'

# The GPU suite alone (tests/gpu); each test is skipped, with its reason
# shown, where this machine has no GPU, too few, or no NCCL. Install the
# CuPy extra first: .venv/bin/pip install -e '.[cuda12]'
test-gpu: $(STAMP)
	$(BIN)/python -m pytest tests/gpu -rs $(PYTEST_ARGS)

# Every notebook at its default (full CIFAR-10) size; executed copies and
# their figures go to notebooks/executed/ (ignored by git).
notebooks: $(STAMP)
	$(BIN)/python -m dasktrain.nbrun --out notebooks/executed notebooks/*.ipynb

clean:
	rm -rf $(VENV) build *.egg-info
