# mlso — two commands for a new user: `make demo` and `make test`.
# Both create .venv and install what they need on a fresh machine.

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
MLSO   := $(VENV)/bin/mlso
STAMP  := $(VENV)/.installed-stamp

.PHONY: demo test test-slow test-gpu lint lib models export-transformer zoo clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

# The MlsoKernel custom-op library (also built on first use into the cache).
lib: $(STAMP)
	$(PY) -m mlso_cli.runtime.build --out build/libmlso_ort.so

models: $(STAMP)
	$(PY) -m models.build_models

# The main job on a bundled model (a torch-exported decoder stack): inspect, optimize, verify.
# --min-speedup 0 packages every region even where the cost model predicts no gain, so the demo
# exercises the whole chain; without a GPU, ONNX Runtime runs each kernel's fallback body.
DEMO_SHAPE := --input-shape hidden=1,16,64
demo: $(STAMP)
	mkdir -p build/demo
	$(MLSO) -v inspect models/transformer_tiny.onnx $(DEMO_SHAPE)
	$(MLSO) -v optimize models/transformer_tiny.onnx $(DEMO_SHAPE) -o build/demo/transformer_tiny.mlso.onnx --min-speedup 0 --force --max-states 20000
	$(MLSO) -v verify models/transformer_tiny.onnx build/demo/transformer_tiny.mlso.onnx $(DEMO_SHAPE)

# Two pytest workers (pytest-xdist): the suite is CPU-bound and single-threaded per test, so on
# 2 cores it takes about half the time of one process. TEST_JOBS=0 runs it in this process.
TEST_JOBS ?= 2
test: $(STAMP)
	$(PY) -m pytest -q -n $(TEST_JOBS) tests
	$(VENV)/bin/ruff check mlso_cli models tests

# Long CPU tests (marked `slow`; `make test` deselects them): thousands of generated graphs on
# the kernel emulator, the search on small Ray clusters (the `ray` extra, installed here), and
# the like.
test-slow: $(STAMP)
	$(PY) -m pip install -q -e '.[dev,ray]'
	$(PY) -m pytest -q -m slow tests

test-gpu: $(STAMP)
	$(PY) -m pytest -q -m gpu tests

lint: $(STAMP)
	$(VENV)/bin/ruff check mlso_cli models tests
	$(VENV)/bin/ruff format --check mlso_cli models tests

# Needs torch (a dev-only tool); the exported file is committed so nothing else needs it.
export-transformer: $(STAMP)
	$(PY) -m pip install -q torch==2.13.0 onnxscript
	$(PY) -m models.export_transformer

# The model zoo (models/zoo.py): transformers decoders of several families, tiny and at a real
# model's layer width, fp32 and fp16, exported to models/zoo/ (git-ignored, about 3.6 GB) with
# MANIFEST.json; then `mlso inspect` on each file, and a comparison with the committed
# models/zoo_manifest.json. torch and transformers go into their own venv, never into .venv.
ZOO_VENV  := .venv-zoo
ZOO_STAMP := $(ZOO_VENV)/.installed-stamp

$(ZOO_STAMP): models/zoo_requirements.txt
	$(PYTHON) -m venv $(ZOO_VENV)
	$(ZOO_VENV)/bin/python -m pip install -q --upgrade pip
	$(ZOO_VENV)/bin/python -m pip install -q -r models/zoo_requirements.txt
	touch $(ZOO_STAMP)

zoo: $(STAMP) $(ZOO_STAMP)
	$(ZOO_VENV)/bin/python -m models.zoo build
	$(PY) -m models.zoo inspect
	$(PY) -m models.zoo check

clean:
	rm -rf $(VENV) models/bench .pytest_cache
