# Every target does its own set-up from a fresh clone: a .venv, then the installs, then the run.
# torch==2.13.0 is installed first and pinned here: it is the CPU build on this machine's disk;
# pyproject only declares a range (users bring their own torch).
# The demo installs only what it runs (no test, flax or lightning packages), which keeps `make demo`
# from a fresh clone within its 8 minutes; `make test` adds the rest to the same .venv.
VENV   := .venv
PY     := $(VENV)/bin/python
BASE   := $(VENV)/.installed-base
STAMP  := $(VENV)/.installed

.PHONY: test check docs demo bench mutation clean

$(BASE): pyproject.toml Makefile
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[torch,jax,demo]'
	touch $(BASE)

$(STAMP): $(BASE)
	$(PY) -m pip install -q -e '.[torch,jax,test,demo,flax,lightning,docs,ft]'
	touch $(STAMP)

# The docs site first (seconds): --strict fails on a broken link, a missing page or an API reference
# that no longer resolves, so the docs cannot rot. The site goes to build/site (git-ignored).
test: $(STAMP) docs
	$(PY) -m pytest -q

# NO_MKDOCS_2_WARNING: without it mkdocs-material prints an end-of-life banner on every build.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

# The fast tier for every edit (under a minute): the algorithms on the simulated N-rank communicator against
# the numpy references, core, the layering, nccl's tables. No process is started. CI runs the full `test`.
check: $(STAMP)
	$(PY) -m pytest -q tests/algorithms tests/core tests/nccl_comm/test_nccl_datatypes.py tests/nccl_comm/test_nccl_streams.py

demo: $(BASE)
	$(VENV)/bin/bagua-x demo

bench: $(BASE)
	$(VENV)/bin/bagua-x bench

# Mutation testing of bagua_x/algorithms and bagua_x/core against the fast
# tests (tests/algorithms, tests/core); configured in pyproject's
# [tool.mutmut], results kept in ./mutants (a rerun only retests what changed). Not part of `test`.
mutation: $(STAMP)
	$(PY) -m pip install -q -e '.[mutation]'
	$(PY) -m mutmut run --max-children 2
	$(PY) -m mutmut results

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info mutants
