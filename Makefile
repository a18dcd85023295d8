# The commands the README names. `run` and `test` set up .venv themselves when it is missing or stale.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
PROTOS := $(wildcard protos/ephost/v1/*.proto)

.PHONY: run test fuzz conformance compat bench soak proto docs ort-api clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

# A folder of ephost/ with no source in it (bytecode or a built library a checkout kept) would shadow a package that
# pyproject's package-dir maps from another folder (ephost.ort is app/ort/): such folders go before each install.
UNSHADOW = for d in ephost/*/; do [ "$$d" = ephost/__pycache__/ ] || [ -n "$$(find "$$d" -name '*.py' -print -quit)" ] \
	|| rm -rf "$$d"; done

# One stamp per set of extras, rebuilt when the project's metadata or its compiled part (ephost.ort's plugin library,
# built by setup.py as the package installs) changes.
$(VENV)/.installed-test: pyproject.toml setup.py app/ort/shim.c | $(BIN)/python
	$(UNSHADOW)
	$(BIN)/python -m pip install -q -e '.[test,openvino]'
	touch $@

$(VENV)/.installed-run: pyproject.toml setup.py app/ort/shim.c | $(BIN)/python
	$(UNSHADOW)
	$(BIN)/python -m pip install -q -e '.[openvino]'
	touch $@

run: $(VENV)/.installed-run
	$(BIN)/ephost run

test: $(VENV)/.installed-test
	$(BIN)/python -m pytest -q

# The wire fuzz test with a long budget (the default run inside `make test` is short). Seed and size can be set:
# make fuzz FUZZ_EXAMPLES=2000 FUZZ_SEED=7
FUZZ_EXAMPLES ?= 1000
FUZZ_SEED ?= 15
fuzz: $(VENV)/.installed-test
	EPHOST_FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) EPHOST_FUZZ_SEED=$(FUZZ_SEED) $(BIN)/python -m pytest -q \
		-o timeout=3600 tests/test_fuzz.py

# The ONNX node suite in full (`make test` runs a fixed quarter of its cases) and the counts the README quotes.
conformance: $(VENV)/.installed-test
	EPHOST_NODE_CASES=all $(BIN)/python -m pytest -q -s tests/test_conformance.py tests/test_ort_bridge_conformance.py

# The ORT bridge on every ONNX Runtime release of the matrix (tests/ort_releases.py), each in its own environment
# under .compat/ (`make test` runs a part of it on one older release). Releases can be named:
# make compat COMPAT_ORT="1.24.4 1.31.1"
COMPAT_ORT ?=
compat: $(VENV)/.installed-test
	$(BIN)/python tests/ort_releases.py $(COMPAT_ORT)

bench: $(VENV)/.installed-test
	$(BIN)/python -m bench

# Rounds of new client processes against one shared onnxruntime worker: its RSS, descriptors and mappings after
# each round, flat from the second on (bench/soak.py). Sizes can be set: make soak SOAK_ARGS="--rounds 10 --unix"
SOAK_ARGS ?=
soak: $(VENV)/.installed-test
	$(BIN)/python -m bench.soak $(SOAK_ARGS)

# ONNX Runtime's own Python API tests (onnxruntime/test/python: onnxruntime_test_python.py,
# onnxruntime_test_python_iobinding.py, helper.py; not part of ephost) with ephost's session classes in ORT's place,
# against ORT's as the baseline: the count and build/ort-api/results.jsonl (tools/ort_api_tests.py).
# make ort-api ORT_TESTS=~/onnxruntime/onnxruntime/test/python
ORT_TESTS ?=
ort-api: $(VENV)/.installed-test
	@test -n "$(ORT_TESTS)" || { echo "make ort-api ORT_TESTS=DIR (the directory of ORT's Python API tests)"; exit 2; }
	$(BIN)/python tools/ort_api_tests.py $(ORT_TESTS) --out build/ort-api/results.jsonl

proto: $(VENV)/.installed-test
	$(BIN)/python -m grpc_tools.protoc -I protos --python_out=. --grpc_python_out=. --pyi_out=. $(PROTOS)

# docs/options.md, made from the code's definitions of every option (a test fails when it no longer matches them)
docs: $(VENV)/.installed-test
	$(BIN)/python tools/options_doc.py

clean:
	rm -rf $(VENV) .compat build *.egg-info app/ort/*.so
