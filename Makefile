# Entry points; the work is done by the scripts in scripts/ (see docs/development.md).
.PHONY: demo test failover fuzz soak api-fuzz client-test services-up services-down services-status services-reset

# Start the local stack, then run the main job (KEEP=1 leaves its projector and gateway running).
demo:
	@KEEP=$(KEEP) bash scripts/demo.sh

# Leave a projector and a gateway running in the background on the local stack (model shop on
# local.orders and local.payments, config/local.toml) and print curl examples; `make down`
# stops them (and those `make demo KEEP=1` left). See docs/operations.md ("Trying it by hand").
.PHONY: up down
up:
	@bash scripts/up.sh up

down:
	@bash scripts/up.sh down

# Run one of examples/ by hand (NAME=order-totals, the default, or NAME=custom-projection): its
# topics created when missing, its projector and a gateway on its parsley.toml left running in
# the background, curl examples printed; `make example-down` stops them (docs/projections.md).
.PHONY: example example-down
example:
	@bash scripts/example.sh up $(or $(NAME),order-totals)

example-down:
	@bash scripts/example.sh down

# Start the local stack, then build and run the whole workspace test suite.
test:
	@bash scripts/test.sh

# The projector failover tests alone: several instances of the binary sharing a model's
# tasks under a session workload, killed, frozen, added and stopped; they print the measured
# takeover times (gateway/tests/it/failover.rs). Needs the services (`make services-up`) and
# DATABASE_URL, PARSLEY_KAFKA_BOOTSTRAP as it prints them.
failover:
	@cargo build -p parsley-projector --bin parsley-projector && cargo test -p parsley-gateway --test it failover -- --nocapture --test-threads=1

# The Kubernetes manifests validated (kubernetes-validate from PyPI) and held to the house
# rules (part of `make test`). See scripts/kubernetes-check.sh.
.PHONY: kubernetes-check
kubernetes-check:
	@bash scripts/kubernetes-check.sh

# README.md's "Running it yourself" block run as written, in order, in one shell (part of
# `make test`; about a minute once built). See scripts/readme-test.sh.
.PHONY: readme-test
readme-test:
	@bash scripts/readme-test.sh

# Long runs of the fuzz tests (the corpus and a short slice run in `make test`): the
# property-based ones (the causes decoder and encoder, engine feed sequences, the gateway's
# write-body parser and token opener, the projector's stored-header framing; CASES=<n> per
# property, default 100000), then the core's cargo-fuzz targets `decode` and `feed` on
# nightly (FUZZ_SECONDS=<n> each, default 600; 0 skips them). See docs/development.md.
fuzz:
	@CASES=$(or $(CASES),100000) FUZZ_SECONDS=$(or $(FUZZ_SECONDS),600) bash scripts/fuzz.sh

# A long simulator sweep: SEEDS=<n> seeds per scenario (default 20000), every scenario's
# `*_sweep` (thirteen scenarios), in release mode (see docs/verification.md).
soak:
	@SIM_SEEDS=$(or $(SEEDS),20000) cargo test --release -p parsley-sim --test simulation -- _sweep --nocapture

# Property-based fuzzing of the HTTP API: schemathesis (installed from PyPI into .local/ on
# first use) against a real gateway and projector and GET /openapi.json, EXAMPLES=<n> per
# operation (default 200); no 5xx but the documented 503s, every answer as documented. See
# docs/gateway.md ("The OpenAPI document").
api-fuzz:
	@EXAMPLES=$(or $(EXAMPLES),200) bash scripts/api-fuzz.sh

# The TypeScript client's tests (clients/typescript): unit tests, then against a real gateway.
client-test:
	@bash scripts/client-tests.sh

# The gateway's benchmarks against the local stack (docs/gateway.md, "Performance"): latency
# against baselines in one run, write-to-visible split into its stages, then throughput and
# latency under load at 1, 16 and 64 connections (reads, pages of 100, writes) against the
# plain handler and a bare produce. Each takes about a minute with its defaults; the
# environment variables documented there make them longer.
# What announcing every change costs (docs/gateway.md, "Kept snapshots"): the clock
# trigger a step fires, and the listener's barrier statement, with pgbench on a scratch
# database (ROUNDS=<n>, default 3).
.PHONY: bench-announce
bench-announce:
	@ROUNDS=$(or $(ROUNDS),3) bash scripts/bench-announce.sh

.PHONY: bench-gateway
bench-gateway:
	@bash scripts/services.sh up && \
	  export DATABASE_URL=$${DATABASE_URL:-postgres://parsley:parsley@127.0.0.1:5432/parsley} \
	  PARSLEY_KAFKA_BOOTSTRAP=$${PARSLEY_KAFKA_BOOTSTRAP:-127.0.0.1:9092} && \
	  cargo bench -p parsley-gateway --bench latency && cargo bench -p parsley-gateway --bench load

# The projector's throughput benchmark against the local stack (docs/projector.md,
# "Throughput"): the projector binary launched as a process, against the naive loop on the
# same workload; records/s from launch and steady, Postgres CPU per 10^5 records. RECORDS=<n>
# (default 200000; 1000000 for the long run), ROUNDS=<n> alternating rounds (default 1); the
# BENCH_* variables documented there pass through. A 4 000-record slice runs in `make test`.
.PHONY: bench-projector
bench-projector:
	@bash scripts/services.sh up && \
	  export DATABASE_URL=$${DATABASE_URL:-postgres://parsley:parsley@127.0.0.1:5432/parsley} \
	  PARSLEY_KAFKA_BOOTSTRAP=$${PARSLEY_KAFKA_BOOTSTRAP:-127.0.0.1:9092} && \
	  BENCH_RECORDS=$${BENCH_RECORDS:-$(or $(RECORDS),200000)} BENCH_ROUNDS=$${BENCH_ROUNDS:-$(or $(ROUNDS),1)} \
	  cargo bench -p parsley-projector --bench throughput

# docker-compose.yml really run (podman, podman-compose, images built here; no registry):
# the schema validated, the images built, read-your-writes through the composed gateway, the
# whole stack restarted with its volumes and checked again, then removed. Not part of `make
# test` (a few minutes). KEEP=1 leaves it up; FRESH=1 rebuilds every image from nothing. See
# docs/operations.md ("Compose").
.PHONY: compose-test
compose-test:
	@KEEP=$(KEEP) FRESH=$(FRESH) bash scripts/compose-test.sh

services-up:
	@bash scripts/services.sh up

services-down:
	@bash scripts/services.sh down

services-status:
	@bash scripts/services.sh status

# Stop the stack and delete all local data (.local/).
services-reset:
	@bash scripts/services.sh reset

# The session-guarantee checker for 60 s against the local stack with the nemesis on: it starts
# 2 projector instances and 2 gateways on config/check.toml (database parsley_check; half the
# single reads through the SQL model check_q's named query), kills,
# freezes and restarts them, terminates their database connections and restarts the broker,
# and judges the history (docs/verification.md, "Session-guarantee checker").
.PHONY: check
check:
	@bash scripts/services.sh up && cargo build -p parsley-projector -p parsley-gateway -p parsley-check && \
	  DATABASE_URL=$${DATABASE_URL:-postgres://parsley:parsley@127.0.0.1:5432/parsley} \
	  PARSLEY_KAFKA_BOOTSTRAP=$${PARSLEY_KAFKA_BOOTSTRAP:-127.0.0.1:9092} \
	  target/debug/parsley-check run --model check --replace-topic check.replace --merge-topic check.merge \
	  --query check_q/document --duration 60s --sessions 8 --spawn-projectors 2 --spawn-gateways 2 --config config/check.toml \
	  --nemesis all --nemesis-interval 4s --history target/check-history.jsonl
