# The two commands a user needs: `make run` and `make test`. Everything else is a step of theirs.
SHELL := /bin/bash
.SHELLFLAGS := -eo pipefail -c
.DEFAULT_GOAL := help

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
EXTRAS := export,serve,test

# the default model's bundle, exported on first `make run`
BUNDLE ?= bundles/all-MiniLM-L6-v2
# `make export CHECKPOINT=/path/to/bert OUT=bundles/mine` exports another checkpoint
CHECKPOINT ?= default
OUT ?= $(BUNDLE)
EXPORT_ARGS ?=
# extra flags for python -m service, e.g. SERVE_ARGS='--replicas 2 --port 9000'
SERVE_ARGS ?=
BENCH_ARGS ?=
# `make bench PEERS=infinity` also measures infinity-emb in the same run (its own venv under results/peers/)
PEERS ?=
LOADTEST_ARGS ?=

# This machine's pip config lists local indexes that may be absent; their warnings are noise.
PIP_QUIET := { grep -v "is ignored: it is neither a file nor a directory" || true; }

.PHONY: help install reference-envs run test export bundle bench bench-tenants bench-representations bench-families bench-int8 bench-request-path bench-models embed bench-jobs profile report reliability loadtest loadtest-overload soak prometheus gpu-check loop-stall clean

help:
	@echo "make run     install into $(VENV), export the default model if $(BUNDLE) is missing, serve it"
	@echo "make test    install into $(VENV) (and the reference environment $(REF_ENV)) and run the whole test suite"
	@echo "make export  export CHECKPOINT=$(CHECKPOINT) to OUT=$(OUT) (EXPORT_ARGS='--force ...')"
	@echo "make bench   the performance targets: in-process references vs the service over HTTP; writes docs/performance.md and the README's headline"
	@echo "make bench-tenants  issue 58's rows alone: a key check's cost per request, keys on vs off, and an interactive key's p99 beside a batch-class flood at 4x capacity (TENANTS_ARGS=...); docs/access.md"
	@echo "make bench-representations  issue 48's rows alone: BGE-M3's three outputs in one pass vs three and vs FlagEmbedding, SPLADE vs SparseEncoder (REPRESENTATIONS_ARGS=...)"
	@echo "make bench-families  MPNet, ModernBERT and Qwen3 shapes at real sizes: the service at its default precision and fp32 vs sentence-transformers fp32 and bf16 (PEERS=infinity: and infinity-emb at both), the engine alone, the physical bound (BENCH_ARGS=--tiny: a smoke run)"
	@echo "make bench-models     a model repository under a Zipf rotation over 8 MiniLM-sized models; docs/models.md"
	@echo "make bench-request-path  the request path's CPU side with the model replaced by a stand-in (0 ms, H100-like), 1 and 2 replicas, beside Ray Serve's echo, the real model and the engine alone; docs/performance.md (REQUEST_PATH_ARGS=--smoke; PEERS=infinity: the peer's request path beside it)"
	@echo "make bench-int8  every int8 method (dynamic, static onnxruntime, NNCF) vs the 0.999 floor, and its speed vs fp32 and bf16"
	@echo "make embed  embed every row of INPUT (Parquet, JSONL, CSV) into Parquet shards in OUTPUT, on Ray Data; run again to resume (EMBED_ARGS=...; docs/jobs.md)"
	@echo "make bench-jobs  the embedding job's texts/s on JOB_TEXTS short texts vs the online service and the engine alone, same run (BENCH_JOBS_ARGS='--nodes 3': on a 3-node loopback cluster, rows by node)"
	@echo "make profile py-spy flame graphs of the replica (and the proxy actor) under load -> results/profile/"
	@echo "make report  make bench with a concurrency sweep, and the plot docs/performance.png"
	@echo "make reliability        fault tests (overload, kills, shutdown, hostile input, bad bundles, auth) -> RELIABILITY.md"
	@echo "make loadtest           locust, headless, about a minute; summary and SLO check (LOADTEST_ARGS=...)"
	@echo "make loadtest-overload  above capacity: load shedding with 503 + Retry-After, bounded p99"
	@echo "make soak               the traffic mix for 10 minutes with Prometheus scraping: throughput, p99, errors, memory (SOAK_ARGS=...)"
	@echo "make loop-stall         p50/p95/p99 of short requests alone and beside large attention responses"
	@echo "make gpu-check          the CUDA path where a GPU is: each CUDA step, parity on CUDA vs CPU, throughput, the service"
	@echo "make image              build the CPU image (podman or docker), report its size, smoke-test it (IMAGE_ARGS=...; minutes, GBs)"
	@echo "make containers         the images as real containers: one, a KubeRay-shaped Ray cluster with a pod lost, the CUDA image, layer sizes"

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@echo "installing into $(VENV) (first time: a few minutes)"
	$(BIN)/python -m pip install --disable-pip-version-check -q -e ".[$(EXTRAS)]" 2>&1 | $(PIP_QUIET)
	@$(BIN)/python -c "import torch, onnxruntime, openvino, ray.serve, bundle, export, service.app" # fail here, not later, if the install is broken
	@touch $(STAMP)

install: $(STAMP)

# The reference environment (docs/testing.md): PyLate and FlagEmbedding, the judges of the ColBERT and BGE-M3
# outputs, at pins .venv cannot hold (tests/reference/requirements.txt), with .venv's torch linked in. Built
# again when the pins, the build script or .venv's install change; a failed build stops with one line.
REF_ENV := .venv-reference
REF_STAMP := $(REF_ENV)/.built-stamp
$(REF_STAMP): tests/reference/requirements.txt tests/reference/build_env.py $(STAMP)
	@echo "building the reference environment $(REF_ENV): PyLate and FlagEmbedding at their own pins (first time: about a minute)"
	@$(BIN)/python tests/reference/build_env.py --env $(REF_ENV)

reference-envs: $(REF_STAMP)

# Exported when missing, or again when it was written by an older version (another manifest schema).
bundle: | $(STAMP)
	@$(BIN)/python -c "import json, sys; from bundle.manifest import SCHEMA_VERSION as v; \
	  sys.exit(json.load(open('$(BUNDLE)/bundle.json')).get('schema_version') != v)" 2>/dev/null || { \
	  echo "exporting the default model to $(BUNDLE) (missing, or from an older version)"; \
	  $(BIN)/python -m export --checkpoint default --out $(BUNDLE) --force; }

export: $(STAMP)
	$(BIN)/python -m export --checkpoint $(CHECKPOINT) --out $(OUT) $(EXPORT_ARGS)

run: bundle
	@$(BIN)/python -m bundle --brief $(BUNDLE)
	@$(BIN)/python -m service --config deploy/serve_config.yaml --bundle $(BUNDLE) $(SERVE_ARGS)

bench: bundle reference-envs
	$(BIN)/python -m benchmarks.bench --bundle $(BUNDLE) $(if $(PEERS),--peers $(PEERS)) $(BENCH_ARGS)
	$(BIN)/python -m benchmarks.representations $(REPRESENTATIONS_ARGS)
	$(BIN)/python -m benchmarks.tenants --bundle $(BUNDLE) $(TENANTS_ARGS)

# API keys (issue 58; docs/access.md): a key check's cost per request (keys off, a key without limits, one with
# limits) and an interactive key's p99 beside a batch-class key flooding at 4x capacity (TENANTS_ARGS='--seconds 5')
TENANTS_ARGS ?=
bench-tenants: bundle
	$(BIN)/python -m benchmarks.tenants --bundle $(BUNDLE) $(TENANTS_ARGS)

# Dense, sparse and multi-vector outputs (issue 48) at base size, random weights: the service's one pass against
# three, against FlagEmbedding in the reference environment and SparseEncoder in-process; rows into
# docs/performance.md. REPRESENTATIONS_ARGS, e.g. '--size tiny --texts 32' (a smoke run: its figures mean nothing).
REPRESENTATIONS_ARGS ?=
bench-representations: bundle reference-envs
	$(BIN)/python -m benchmarks.representations $(REPRESENTATIONS_ARGS)

# The embedding job (docs/jobs.md): INPUT files or directories in, OUTPUT directory out, resumable
embed: bundle
	@test -n "$(INPUT)" -a -n "$(OUTPUT)" || { echo "make embed INPUT=FILE... OUTPUT=DIR [EMBED_ARGS='--id-column id ...']"; exit 2; }
	$(BIN)/python -m jobs embed --bundle $(BUNDLE) --input $(INPUT) --output $(OUTPUT) $(EMBED_ARGS)

# The job's texts/s against the online service's best client-batch rate and benchmarks/engine_alone.py's,
# one after the other in one run (issue 50: 100k texts, >= 1.3x and >= 0.9x); BENCH_JOBS_ARGS="--nodes 3":
# the job on a loopback 3-node Ray cluster, rows done by each node
JOB_TEXTS ?= 100000
bench-jobs: bundle
	$(BIN)/python -m benchmarks.jobs --bundle $(BUNDLE) --texts $(JOB_TEXTS) $(BENCH_JOBS_ARGS)

# a model repository under a Zipf rotation (docs/models.md): the hot model's p99 against one model alone, a cold
# load's added latency, loads per 1,000 requests, the replica's memory against the budget (BENCH_MODELS_ARGS)
BENCH_MODELS_ARGS ?=
bench-models: bundle
	$(BIN)/python -m benchmarks.model_repository --bundle $(BUNDLE) $(BENCH_MODELS_ARGS)

# MPNet, ModernBERT and Qwen3 shapes at their real sizes (random weights): the service against
# sentence-transformers (and infinity-emb with PEERS=infinity); rows into docs/performance.md
bench-families: bundle
	$(BIN)/python -m benchmarks.families $(if $(PEERS),--peers $(PEERS)) $(BENCH_ARGS)

# int8 methods on the default model and the base shapes (random weights): gate figures and speed in one run
bench-int8: bundle
	$(BIN)/python -m benchmarks.int8 --bundle $(BUNDLE) $(BENCH_ARGS)

# The request path as a GPU host sees it (issue 56): the model replaced by benchmarks/standin.py at 0 ms and at
# docs/gpu.md's H100 cost per run, single texts and client batches of 32 under wrk, 1 and 2 replicas, beside
# Ray Serve's echo ceiling, the real model and the engine alone; rows into docs/performance.md and
# results/request_path.json; PEERS=infinity adds infinity-emb's request path (a near-zero model, its own venv).
# REQUEST_PATH_ARGS, e.g. '--seconds 5' or '--smoke' (its figures mean nothing).
REQUEST_PATH_ARGS ?=
bench-request-path: bundle wrk
	$(BIN)/python -m benchmarks.request_path --bundle $(BUNDLE) $(if $(PEERS),--peers $(PEERS)) $(REQUEST_PATH_ARGS)

# py-spy flame graphs of the replica under single-text load (PROFILE_ARGS='--ingress proxy --precision int8')
PROFILE_ARGS ?=
profile: bundle
	$(BIN)/python -m benchmarks.profile --bundle $(BUNDLE) $(PROFILE_ARGS)

# the performance report: the benchmark with a concurrency sweep, then the plot in docs/
report: bundle
	$(BIN)/python -m benchmarks.bench --bundle $(BUNDLE) --sweep $(if $(PEERS),--peers $(PEERS)) $(BENCH_ARGS)
	$(BIN)/python -m benchmarks.plot results/bench.json docs/performance.png

# RELIABILITY.md from the fault tests' own records
RELIABILITY_TESTS := tests/test_service_errors.py tests/test_cancellation.py tests/test_replica_failure.py \
	tests/test_service_cli.py tests/test_hostile_input.py tests/test_bad_artifacts.py tests/test_auth.py \
	tests/test_models.py tests/test_multinode.py tests/test_soak.py tests/test_hostile_grpc.py tests/test_hostile_tei_cohere.py \
	tests/test_hostile_headers.py tests/test_hostile_long_texts.py \
	tests/test_batch_uploads.py tests/test_batch_runner.py tests/test_jobs_inputs.py tests/test_jobs_hostile.py \
	tests/test_model_repository.py
reliability: $(STAMP) prometheus
	rm -f results/reliability.jsonl
	RELIABILITY_LOG=results/reliability.jsonl $(BIN)/python -m pytest -q $(RELIABILITY_TESTS)
	@# the last `make soak` that passed, if any, keeps its row
	@if [ -f results/soak/reliability.jsonl ]; then cat results/soak/reliability.jsonl >> results/reliability.jsonl; fi
	@# and the last `make containers` that passed (a worker pod lost, a container stopped under load)
	@if [ -f results/containers/reliability.jsonl ]; then cat results/containers/reliability.jsonl >> results/reliability.jsonl; fi
	$(BIN)/python -m tests.reliability RELIABILITY.md

# LOADTEST_ARGS, e.g. '--host http://10.0.0.5:8000 --users 32 --duration 2m --max-p99-ms 2000'
loadtest: bundle
	$(BIN)/python -m loadtests.run $(LOADTEST_ARGS)

loadtest-overload: bundle
	$(BIN)/python -m loadtests.run --overload --users 48 --spawn-rate 48 --duration 30s --results results/overload $(LOADTEST_ARGS)

# The locust traffic mix for a bounded time with a real Prometheus scraping the service: throughput,
# p99, errors and the memory of each replica and the ingress, from Prometheus, into results/soak/
# (soak.csv, soak.png); fails on errors or memory growth. SOAK_ARGS, e.g. '--duration 1h --users 32'.
SOAK_ARGS ?=
soak: bundle prometheus
	$(BIN)/python -m loadtests.soak $(SOAK_ARGS)

# The browser test drives headless Chromium through chromedriver, both from Debian's packages
# (browser builds cannot be downloaded by a driver library here): installed when missing and
# apt-get can, else one line that names them.
.PHONY: browser
browser:
	@if command -v chromium >/dev/null 2>&1 && command -v chromedriver >/dev/null 2>&1; then :; \
	elif command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ]; then \
	  echo "installing chromium and chromium-driver (Debian packages) for the browser test"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null; \
	else echo "the browser test needs the Debian packages chromium and chromium-driver: apt-get install chromium chromium-driver" >&2; exit 1; fi

# Prometheus and promtool from Debian's package, for the tests of the dashboard's queries and the
# alert rules and for `make soak`: installed when missing and apt-get can, else one line naming it.
prometheus:
	@if command -v prometheus >/dev/null 2>&1 && command -v promtool >/dev/null 2>&1; then :; \
	elif command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ]; then \
	  echo "installing prometheus (Debian package: prometheus and promtool) for the metrics and alert tests"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null; \
	else echo "the metrics and alert tests need the Debian package prometheus (prometheus, promtool): apt-get install prometheus" >&2; exit 1; fi

# wrk from Debian's package, the load generator of the request-path harness (its smoke test) and of
# make bench-request-path: installed when missing and apt-get can, else one line naming it.
.PHONY: wrk
wrk:
	@if command -v wrk >/dev/null 2>&1; then :; \
	elif command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ]; then \
	  echo "installing wrk (Debian package) for the request-path harness"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends wrk >/dev/null; \
	else echo "the request-path harness needs the Debian package wrk: apt-get install wrk" >&2; exit 1; fi

# redis-server from Debian's package, the rate-limit store of the keys' limits tests (tests/test_quotas.py):
# installed when missing and apt-get can, else one line naming it.
.PHONY: redis
redis:
	@if command -v redis-server >/dev/null 2>&1; then :; \
	elif command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ]; then \
	  echo "installing redis-server (Debian package) for the keys' limits tests"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends redis-server >/dev/null; \
	else echo "the keys' limits tests need the Debian package redis-server: apt-get install redis-server" >&2; exit 1; fi

# pytest-xdist workers for make test, each given whole files: much of the suite waits on Ray, services
# and exports starting, so two share a 2-core machine well; each starts at most one Ray Serve session
# and they share the exported bundles (tests/conftest.py). TEST_WORKERS=0 runs it in this one process.
# Then the tests marked `serial` (bounds on time under load) run alone, one at a time, on the bundles the
# workers exported ($$TEST_SHARED_DIR); both phases always run (`&& x=0 || x=$$?`: the recipe's shell has -e),
# and make test fails if either did.
TEST_WORKERS ?= 2

test: $(STAMP) reference-envs browser prometheus wrk redis
	@shared=$$(mktemp -d); trap 'rm -rf "$$shared"' EXIT; \
	TEST_SHARED_DIR=$$shared $(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile -m "not serial" && parallel=0 || parallel=$$?; \
	echo "make test: the serial phase (tests whose bounds another test's load would decide)"; \
	TEST_SHARED_DIR=$$shared $(BIN)/python -m pytest -m serial && serial=0 || serial=$$?; \
	echo "make test: parallel phase exit $$parallel, serial phase exit $$serial"; \
	test $$parallel = 0 -a $$serial = 0

# The CPU image from deploy/Dockerfile with podman or docker, its size and build time, then a smoke test
# of it (docs/images.md). Where no base image can be pulled, the bases are made from Debian's packages
# (debootstrap + podman import, cached); podman and debootstrap are installed when missing and apt-get
# can. Minutes and gigabytes, so not part of `make test`. IMAGE_ARGS, e.g. '--dockerfile
# deploy/Dockerfile.cuda', '--serve-base rayproject/ray:2.60.0-py311-cpu', '--no-smoke';
# LOCAL_BASE=1 builds on the local base without trying to pull. Results in results/image/.
IMAGE_ARGS ?=
.PHONY: image image-smoke
image:
	$(PYTHON) deploy/image/build.py $(IMAGE_ARGS)

image-smoke:
	$(PYTHON) deploy/image/build.py --smoke-only $(IMAGE_ARGS)

# The images run as a cluster runs them (docs/images.md): the CPU image as one container (CMD,
# HEALTHCHECK, uid 1000, a worker pod's limits, SIGTERM with requests in flight); a head and two
# worker containers started as KubeRay starts deploy/k8s/rayservice-cpu.yaml's pods, its Serve config
# deployed, a worker killed under load and started again, a real Prometheus scraping every node; the
# CUDA image's libraries and its no-GPU line; each image's layers. Builds each image that is not here
# first, as `make image` does (podman installed when missing; about 5 minutes each), then about 5
# minutes; rebuild a stale one with `make image`. Rows for `make reliability`.
# CONTAINERS_ARGS, e.g. '--only cluster --phase-s 30'.
CONTAINERS_ARGS ?=
.PHONY: containers
containers: $(STAMP) prometheus
	$(BIN)/python deploy/image/containers.py $(CONTAINERS_ARGS)

# What building large responses does to the replica's other requests: short requests' latency alone
# and while other clients fetch ~60 MB attention responses (LOOP_STALL_ARGS='--seconds 30').
LOOP_STALL_ARGS ?=
loop-stall: bundle
	$(BIN)/python -m benchmarks.loop_stall --bundle $(BUNDLE) $(LOOP_STALL_ARGS)

# The CUDA path, for a machine with a GPU (docs/gpu.md): installs the `cuda` extra into the venv when
# its libraries do not load, then one line per CUDA step (build, libraries, driver, device), parity of
# every graph on CUDA against CPU, throughput of batches of 1/8/32/128, and `python -m service
# --provider cuda` end to end. Without a usable GPU it exits non-zero after the library line, naming
# the missing driver or device. Not part of `make test` (the suite runs its code with
# --dry-run-on-cpu). GPU_CHECK_ARGS, e.g. '--repeats 50 --no-service'.
GPU_CHECK_ARGS ?=
gpu-check: bundle
	@$(BIN)/python -m service.runtimes.cuda --libraries >/dev/null 2>&1 || { \
	  echo "installing the cuda extra into $(VENV) (onnxruntime-gpu's CUDA 13 and cuDNN 9 wheels, about 2.5 GB)"; \
	  $(BIN)/python -m pip install --disable-pip-version-check -q -e ".[$(EXTRAS),cuda]" 2>&1 | $(PIP_QUIET); }
	$(BIN)/python -m benchmarks.gpu_check --bundle $(BUNDLE) $(GPU_CHECK_ARGS)

clean:
	rm -rf bundles .pytest_cache
