# The commands the README names. `run` and `test` set up .venv themselves when it is missing or stale.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
PROTOS := $(wildcard protos/ephost/v1/*.proto)

.PHONY: run test bench proto clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

# One stamp per set of extras, rebuilt when the project's metadata changes.
$(VENV)/.installed-test: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -q -e '.[test,openvino]'
	touch $@

$(VENV)/.installed-run: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -q -e '.[openvino]'
	touch $@

run: $(VENV)/.installed-run
	$(BIN)/ephost run

test: $(VENV)/.installed-test
	$(BIN)/python -m pytest -q

bench: $(VENV)/.installed-test
	$(BIN)/python -m bench

proto: $(VENV)/.installed-test
	$(BIN)/python -m grpc_tools.protoc -I protos --python_out=. --grpc_python_out=. --pyi_out=. $(PROTOS)

clean:
	rm -rf $(VENV) build *.egg-info
