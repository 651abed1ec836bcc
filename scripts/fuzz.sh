#!/usr/bin/env bash
# `make fuzz`: the long fuzz runs. Needs no services.
#  1. The property-based fuzz tests with many cases, in release mode, on stable: CASES=<n>
#     per property (default 100000), the feed and decode properties of tests/fuzz_corpus.rs
#     among them.
#  2. The cargo-fuzz targets of the core (fuzz/: `decode`, `feed`), coverage-guided by
#     libFuzzer on nightly, FUZZ_SECONDS=<n> each (default 600; 0 skips them). They need a
#     nightly toolchain and `cargo install cargo-fuzz`. The committed corpus (fuzz/corpus/)
#     is read, never written: new corpus entries go to .local/fuzz/corpus/<target>/, a
#     crashing input to fuzz/artifacts/<target>/ (docs/development.md, "Fuzzing").
set -Eeuo pipefail
# shellcheck source=scripts/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
cd "$PARSLEY_ROOT"
export PROPTEST_CASES="${CASES:-100000}"
seconds="${FUZZ_SECONDS:-600}"
say "fuzzing with $PROPTEST_CASES cases per property"
cargo test --release -p parsley --test codec_props
cargo test --release -p parsley --test fuzz_corpus
cargo test --release -p parsley-gateway --lib fuzz_
cargo test --release -p parsley-projector --lib fuzz_

if [ "$seconds" = 0 ]; then
    say "FUZZ_SECONDS=0: the cargo-fuzz targets are skipped"
    exit 0
fi
if ! cargo +nightly fuzz --version >/dev/null 2>&1; then
    fail "the coverage-guided runs need cargo-fuzz on a nightly toolchain: \`rustup toolchain install nightly\` and \`cargo install cargo-fuzz\` (or FUZZ_SECONDS=0 to skip them)"
fi
for target in decode feed; do
    work="$LOCAL_DIR/fuzz/corpus/$target"
    mkdir -p "$work"
    say "cargo-fuzz: $target for ${seconds}s (new corpus entries in ${work#"$PARSLEY_ROOT"/})"
    cargo +nightly fuzz run "$target" "$work" "fuzz/corpus/$target" -- -max_total_time="$seconds"
done
say "the cargo-fuzz targets found nothing in ${seconds}s each"
