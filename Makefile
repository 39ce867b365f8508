# mmsplit — the two commands a fresh machine needs are `make demo` and `make test`.
# Every target bootstraps .venv from requirements.txt first.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
# What the services need (make demo), then what tests and tools add (make test, check).
STAMP  := $(VENV)/.installed-stamp
DEV    := $(VENV)/.dev-stamp
# The client's own dependencies as wheels: tests/test_packaging.py installs the
# built client wheel into a fresh venv from here, with no registry.
CLIENT_WHEELS := $(VENV)/client-wheels
UV_PIN := uv==0.13.9
FIND_LINKS := $(or $(PIP_FIND_LINKS),$(shell $(PYTHON) -m pip config get global.find-links 2>/dev/null))
UV := $(BIN)/uv pip install --quiet --python $(BIN)/python $(foreach d,$(FIND_LINKS),--find-links $(d))
# Nothing is byte-compiled at install time: the first process to import a
# module caches its bytecode, so only what runs is compiled, once (compiling
# all of site-packages took 20 s of two cores). An environment that sets
# PYTHONDONTWRITEBYTECODE, as the CI machine does, would have every service
# process compile torch and transformers from source at each start: not for
# what make runs.
unexport PYTHONDONTWRITEBYTECODE

.PHONY: venv dev demo test check fmt proto baseline bench bench-engine dist wheels image clean

$(STAMP): requirements.txt pyproject.toml client/pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	# uv installs the pinned requirements in seconds (pip took ~45 s of a
	# fresh `make test`); it reads no pip configuration, so the directories
	# pip finds wheels in (torch's CPU build) are handed to it.
	$(BIN)/python -m pip install --quiet $(UV_PIN)
	$(UV) -r requirements.txt
	# The two distributions of this repository, editable: the light client
	# (the `mmsplit` package) and the server, which depends on it.
	$(BIN)/python -m pip install --quiet --no-deps --no-build-isolation -e ./client -e .
	touch $@

$(DEV): $(STAMP) requirements-dev.txt tests/js/package-lock.json
	@command -v kubectl >/dev/null || { echo "installing kubectl (renders deploy/ in the tests)"; \
	  apt-get install -y -q kubectl >/dev/null 2>&1 || apt-get install -y -q kubernetes-client; }
	# Node.js and @grpc/grpc-js: the contract as a JavaScript client meets it
	# (tests/e2e/test_other_clients.py), at the versions tests/js's lock file pins.
	@command -v npm >/dev/null || { echo "installing Node.js (a gRPC client of the tests)"; \
	  apt-get install -y -q nodejs npm >/dev/null; }
	@command -v curl >/dev/null || apt-get install -y -q curl >/dev/null
	cd tests/js && npm ci --no-audit --no-fund --loglevel=error
	$(UV) -r requirements-dev.txt
	$(BIN)/python -m pip download --quiet --only-binary :all: --dest $(CLIENT_WHEELS) \
	  $$(grep -E '^(grpcio|grpcio-status|grpcio-health-checking|grpcio-reflection|protobuf|googleapis-common-protos)==' requirements.txt)
	$(MAKE) --no-print-directory $(BIN)/promtool
	touch $@

# promtool (checks the /metrics exposition in the tests): the binary alone,
# taken out of Debian's prometheus package, which is not installed.
$(BIN)/promtool:
	rm -rf $(VENV)/.promtool && mkdir -p $(VENV)/.promtool
	cd $(VENV)/.promtool && apt-get download -q prometheus >/dev/null 2>&1 \
	  && dpkg-deb --fsys-tarfile prometheus_*.deb | tar -x ./usr/bin/promtool
	mv $(VENV)/.promtool/usr/bin/promtool $@ && rm -rf $(VENV)/.promtool

venv: $(STAMP)
dev: $(DEV)

## Both services, a tiny local model, scripted requests, a table of outcomes.
demo: $(STAMP)
	$(BIN)/mmsplit demo

## The whole test suite (contract checks included), three workers (a file to a worker).
## Three on two cores: the tests wait on services much of their time, and a
## third worker fills those waits (a fresh run 7:34 with two, 6:48 with three).
test: $(DEV)
	$(BIN)/python -m pytest -n 3 --dist loadfile

## Lint, types and the proto style: ruff, mypy, buf lint, buf format.
check: $(DEV)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/buf lint protos
	$(BIN)/buf format --diff --exit-code protos

fmt: $(DEV)
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .
	$(BIN)/buf format -w protos

## Regenerate the committed Python code of the protos.
proto: $(DEV)
	$(BIN)/python tools/gen_protos.py

## Record the current contract as the baseline `buf breaking` compares against.
baseline: $(DEV)
	$(BIN)/buf build protos -o protos/baseline.binpb

## Benchmarks (each prints ratios against a baseline measured in the same run).
bench: $(STAMP)
	$(BIN)/python bench/shm_handoff.py
	$(BIN)/python bench/consensus.py

## The serving engine against in-process generate (about 15 minutes on 2 cores), and the cost of streaming.
bench-engine: $(STAMP)
	$(BIN)/python bench/engine.py
	$(BIN)/python bench/streaming.py

## Both wheels into dist/: mmsplit-client (light) and mmsplit (the server, depending on it).
dist: $(STAMP)
	rm -rf dist build && $(BIN)/python -m pip wheel --quiet --no-deps --no-build-isolation --wheel-dir dist ./client . && rm -rf build
	@ls dist

## The CPU build of torch for the container image (Containerfile copies wheels/).
wheels: $(STAMP)
	$(BIN)/python -m pip download --quiet --no-deps --dest wheels torch==2.13.0

## The container image (needs podman or docker; none on the development machines).
image: wheels
	$${CONTAINER_ENGINE:-podman} build -f Containerfile -t mmsplit:$$($(BIN)/python -c 'import mmsplit; print(mmsplit.__version__)') .

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache tests/js/node_modules
