# Every target builds/refreshes .venv from the project's own files first.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp
WORKDIR ?= /tmp/snm_jax_demo

.PHONY: demo test bench bench-full clean venv

venv: $(STAMP)

# The packages are byte-compiled by compileall on every core, not by pip one file at a time (37 s
# against 49 s in all); compiled they must be: with PYTHONDONTWRITEBYTECODE set (as on these machines) a process
# never writes what it compiles on import, and every test subprocess would compile jax again.
# Not the packages' own test folders, pip or setuptools, which nothing here imports (compileall
# 13.3 / 14.7 s against 20.5 / 18.9 s for everything, alternated, 2026-11-28).
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet --no-compile -e '.[test]'
	$(PY) -m compileall -q -j 0 -x '/(tests|pip|setuptools)/' $(VENV)/lib > /dev/null
	touch $(STAMP)

## Main job: train SNM top-1/top-16 and negative sampling on Bibtex, print a Table-2-style comparison.
demo: $(STAMP)
	$(PY) -m experiments.demo --workdir=$(WORKDIR)

## The whole test suite (this is what CI runs): the parallel part, then the timing-ratio tests alone.
# --max-worker-restart=0: a crashed worker ends the run at once, naming the test it ran. pytest-xdist
# 3.8 with --dist=loadfile can deadlock after replacing a crashed worker (it re-queues the files that
# worker had finished as empty work: pytest-dev/pytest-xdist#1378), which once cost CI its whole budget.
test: $(STAMP)
	$(PY) -m pytest -q -n 2 --dist=loadfile --max-worker-restart=0 -m "not timing" tests
	$(PY) -m pytest -q -m timing tests

bench: $(STAMP)
	$(PY) -m benchmarks.run_all --size=small

bench-full: $(STAMP)
	$(PY) -m benchmarks.run_all --size=full

clean:
	rm -rf $(VENV) build *.egg-info
