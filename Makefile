# Sluice: the two commands that matter are `make demo` and `make test`.
# Every target does its own set-up, so both work on a fresh machine.
PY      := .venv/bin/python
PYTEST  := $(PY) -m pytest

.PHONY: setup protos infra-up infra-down migrate seed demo test test-unit test-packaging fuzz chaos lint bench bench-platform bench-platform-seed bench-hops bench-http bench-routing bench-autoscaler bench-traffic bench-host-tier sim plan clean

setup:                       ## venv + pinned packages + gRPC stubs + Kafka jars + PostgreSQL server
	infra/setup.sh

protos:                      ## regenerate the sluice.v1 stubs from protos/ (setup does this too)
	$(PY) -m grpc_tools.protoc -Iprotos --python_out=. --pyi_out=. --grpc_python_out=. protos/sluice/v1/*.proto

infra-up: setup              ## start PostgreSQL and Kafka (idempotent) and wait until healthy
	infra/up.sh

infra-down:                  ## stop PostgreSQL and Kafka (data under .sluice/ is kept)
	infra/down.sh

migrate: infra-up
	.venv/bin/alembic upgrade head

seed: migrate                ## demo tenant, API key and model
	$(PY) -m sluice.ledger.seed

demo: seed                   ## the platform end to end: stream, resume, cancel, worker loss, usage
	$(PY) -m sluice.demo

test: infra-up               ## the whole suite against real PostgreSQL, Kafka and Triton
	$(PYTEST) -q -rfEs

test-packaging: infra-up     ## both wheels built, installed into fresh venvs outside the checkout, used (slow)
	SLUICE_PACKAGING=1 $(PYTEST) -q -rfEs tests/test_packaging.py

test-unit: setup             ## pure tests only (no servers)
	$(PYTEST) -q -m "not integration"

fuzz: infra-up               ## every RPC's fields fuzzed (hypothesis), 400 requests per property (make test: 40)
	SLUICE_FUZZ_EXAMPLES=400 $(PYTEST) -q -s tests/test_fuzz_rpcs.py

chaos: infra-up              ## the fault suite (burst, PostgreSQL restart, Kafka kills, replica/worker SIGKILL+SIGSTOP, ...), a table
	SLUICE_CHAOS=1 $(PYTEST) -q -rfEs tests/test_chaos.py tests/test_chaos_infra.py tests/test_chaos_postgres.py tests/test_chaos_leases.py tests/test_autoscaler_live.py

lint: setup                  ## ruff everywhere; mypy (strict on engine, planner, router)
	.venv/bin/ruff check .
	tree=$$(infra/typecheck_tree.sh) && MYPYPATH=$$tree .venv/bin/mypy $$tree/sluice $$tree/sluice_client bench infra/kafka_admin.py

bench: infra-up              ## benchmarks print figures and ratios; they never fail on timing
	$(PY) -m bench

bench-platform: infra-up     ## platform CPU per token/run/Submit, Submit p95, TTFT added, INTERRUPTED (issue 9); QUICK=1: small; PHASES=ttft,runs,...
	$(PY) -m bench.bench_platform $(if $(QUICK),--quick,) $(if $(PHASES),--phases $(PHASES),) $(if $(PROMPT_TOKENS),--prompt-tokens $(PROMPT_TOKENS),)

bench-platform-seed: infra-up  ## the same at seed 002's load: 2,000-token prompts, each Submit's its own corpus slice (PROMPT_SOURCE=repeat: one text; PROMPT_TOKENS=0: one sentence), ~117 tokens/s per stream from wire replicas (bench/wire_replica.py) at 8.5 ms/token
	$(PY) -m bench.bench_platform --wire-replicas --token-delay-ms 8.5 --prompt-tokens $(or $(PROMPT_TOKENS),2000) --prompt-source $(or $(PROMPT_SOURCE),corpus) $(if $(QUICK),--quick,) $(if $(PHASES),--phases $(PHASES),)

bench-hops: infra-up           ## one process hop (pipe, PostgreSQL, Kafka) by how long it was idle: the VM's wake-up cost in TTFT
	$(PY) -m bench.bench_hops

bench-http: infra-up         ## HTTP edge vs gRPC, the same requests side by side: added p50/p95 (issue 11: <= 3 ms p95)
	$(PY) -m bench.bench_http_edge

bench-routing: setup         ## every routing policy (Sluice's and its peers') on every workload, simulated; tables + PNGs
	$(PY) -m bench.bench_routing

bench-autoscaler: setup      ## seed 000: traffic x2 in 5 min and x3 in 1 min, simulated, with and without a warm pool; tables + PNGs
	$(PY) -m bench.bench_autoscaler

bench-traffic: setup         ## batch filling a trough (interactive p95 TTFT alone vs with batch) and the ladder under a traffic step; QUICK=1
	$(PY) -m bench.bench_traffic $(if $(QUICK),--quick,)

bench-host-tier: setup       ## seed 003's chat (3-minute thinks) with and without the host KV tier; hit rate, TTFT
	$(PY) -m bench.bench_host_tier

sim: setup                   ## seed 003's fleet on the simulator (HOST_TIER=1: with the host KV tier)
	$(PY) -m sluice.sim --preset seed003 $(if $(HOST_TIER),--host-tier)

plan: setup                  ## size seed 003's brief
	$(PY) -m sluice.planner examples/briefs/seed003.yaml

clean: infra-down
	rm -rf .sluice
