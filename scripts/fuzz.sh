#!/usr/bin/env bash
# `make fuzz`: the property-based fuzz tests with many cases, in release mode. Needs no
# services. CASES=<n> sets the cases per property (default 100000).
set -Eeuo pipefail
# shellcheck source=scripts/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
cd "$PARSLEY_ROOT"
export PROPTEST_CASES="${CASES:-100000}"
say "fuzzing with $PROPTEST_CASES cases per property"
cargo test --release -p parsley --test codec_props
cargo test --release -p parsley-gateway --lib fuzz_
cargo test --release -p parsley-projector --lib fuzz_
