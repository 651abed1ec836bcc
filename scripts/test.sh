#!/usr/bin/env bash
# `make test`: start the local stack, build the workspace's tests, run them.
# Exit status is the test suite's. Prints how long each phase took.
set -Eeuo pipefail

# shellcheck source=scripts/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
cd "$PARSLEY_ROOT"

if ! command -v cargo >/dev/null 2>&1 && [ -x "$HOME/.cargo/bin/cargo" ]; then
    export PATH="$HOME/.cargo/bin:$PATH"
fi
command -v cargo >/dev/null 2>&1 || fail "cargo not found: a Rust toolchain is needed to build the workspace"
# The bundled librdkafka is built from C sources by its configure script and make.
if ! command -v cc >/dev/null 2>&1 || ! command -v make >/dev/null 2>&1; then
    say "a C compiler and make are needed to build librdkafka"
    apt_install build-essential
fi

# A one-shot build (CI) gains nothing from incremental compilation, whose caches were a third
# of the build's disk use; a developer's repeated `make test` keeps them.
if [ -n "${CI:-}" ]; then
    export CARGO_INCREMENTAL="${CARGO_INCREMENTAL:-0}"
fi
# The workspace's test build needs about 2 GiB under target/ (1.8 GiB measured, no incremental caches); say so
# before a full disk turns into a compiler's "IO failure on output stream".
free_kib="$(df -Pk "$PARSLEY_ROOT" | awk 'NR == 2 { print $4 }')"
if [ -n "$free_kib" ] && [ "$free_kib" -lt $((3 * 1024 * 1024)) ]; then
    warn "only $((free_kib / 1024)) MiB free on the disk holding $PARSLEY_ROOT: the test build needs about 2 GiB (target/)"
fi

phase() { printf '\n==== %s ====\n' "$*"; }

t0="$(now_s)"
phase "services up"
bash scripts/services.sh up
t1="$(now_s)"

export DATABASE_URL="$DATABASE_URL_LOCAL"
export PARSLEY_KAFKA_BOOTSTRAP="$KAFKA_BOOTSTRAP"

# The invariants prose cannot keep: formatting and lints, on every crate and target.
phase "lint (cargo fmt --check; cargo clippy -D warnings)"
command -v rustfmt >/dev/null 2>&1 || fail "rustfmt not found: \`rustup component add rustfmt\`"
cargo fmt --all --check || fail "the tree is not formatted: run \`cargo fmt --all\`"
cargo clippy --version >/dev/null 2>&1 || fail "clippy not found: \`rustup component add clippy\`"
cargo clippy --workspace --all-targets -- -D warnings || fail "clippy found warnings (denied)"
t_lint="$(now_s)"

# The Kubernetes manifests (deploy/kubernetes/) against the API's schemas and the house rules.
# In CI a validator that cannot be installed fails the run; on a developer's machine the
# check is skipped with a warning (as the API fuzzer is).
phase "Kubernetes manifests (kubernetes-validate --strict; the house rules)"
k8s_optional=1
if [ -n "${CI:-}" ]; then
    k8s_optional=0
fi
KUBERNETES_CHECK_OPTIONAL=$k8s_optional bash scripts/kubernetes-check.sh || rc_k8s=$?
t_k8s="$(now_s)"

phase "build (cargo test --workspace --no-run)"
cargo test --workspace --no-run
t2="$(now_s)"

phase "test (cargo test --workspace --no-fail-fast)"
rc="${rc_k8s:-0}"
cargo test --workspace --no-fail-fast || rc=$?
t_cargo="$(now_s)"

# A slice of the projector's throughput benchmark (`make bench-projector` is the long run),
# in the test build: 4 000 records of two workloads through the projector binary and the
# naive loop's process, each run checked to apply every record once, its database and
# topics removed after it. It proves the benchmark works; its figures mean nothing at this
# size.
phase "benchmark slice (projector throughput, 4 000 records)"
BENCH_RECORDS=4000 BENCH_VARIANTS=projector,naive-proc BENCH_WORKLOADS=upsert-100b,mix-100b \
    cargo test -p parsley-projector --bench throughput -- --bench || rc=$?
t_bench="$(now_s)"

# README.md's "Running it yourself" block, run as written (its projector and gateway on
# config/parsley.toml, the session-guarantee checker for 30 s against them).
phase "README (the \"Running it yourself\" block as written)"
bash scripts/readme-test.sh || rc=$?
t_readme="$(now_s)"

# The HTTP API as clients see it, on one real gateway and projector: the TypeScript client's
# type check and tests, then a short schemathesis run. In CI (`CI` set, as .ci/run does) a
# fuzzer that cannot be installed or that crashes fails the run; on a developer's machine it
# is skipped with a warning.
fuzz_optional=1
if [ -n "${CI:-}" ]; then
    fuzz_optional=0
fi
phase "API (TypeScript client type check and tests; schemathesis, ${API_FUZZ_EXAMPLES:-100} examples per operation)"
bash scripts/api-stack.sh bash -c \
    "bash scripts/client-tests.sh && API_FUZZ_OPTIONAL=$fuzz_optional EXAMPLES=${API_FUZZ_EXAMPLES:-100} bash scripts/api-fuzz.sh" ||
    rc=$?
t3="$(now_s)"

install_s="?" start_s="?"
if [ -s "$RUN_DIR/last-up-timings" ]; then
    install_s="$(sed -n 's/^install=//p' "$RUN_DIR/last-up-timings")"
    start_s="$(sed -n 's/^start=//p' "$RUN_DIR/last-up-timings")"
fi
phase "timings"
printf '  services up: %4ss  (install/check %ss, start/readiness %ss)\n' "$((t1 - t0))" "$install_s" "$start_s"
printf '  lint:        %4ss\n' "$((t_lint - t1))"
printf '  kubernetes:  %4ss\n' "$((t_k8s - t_lint))"
printf '  build:       %4ss\n' "$((t2 - t_k8s))"
printf '  test:        %4ss\n' "$((t_cargo - t2))"
printf '  bench slice: %4ss\n' "$((t_bench - t_cargo))"
printf '  README:      %4ss\n' "$((t_readme - t_bench))"
printf '  API:         %4ss\n' "$((t3 - t_readme))"
printf '  total:       %4ss\n' "$((t3 - t0))"
if [ "$rc" = 0 ]; then
    echo "make test: the test suite passed"
else
    echo "make test: the test suite FAILED (exit $rc)"
fi
exit "$rc"
