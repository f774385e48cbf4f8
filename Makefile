# Every target does its own set-up from a fresh clone: a .venv, then the installs, then the run.
# torch==2.13.0 is installed first and pinned here: it is the CPU build on this machine's disk;
# pyproject only declares a range (users bring their own torch).
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: test demo bench clean

$(STAMP): pyproject.toml Makefile
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[torch,jax,test,demo,lightning]'
	touch $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q

demo: $(STAMP)
	$(VENV)/bin/bagua-x demo

bench: $(STAMP)
	$(VENV)/bin/bagua-x bench

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
