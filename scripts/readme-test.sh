#!/usr/bin/env bash
# scripts/readme-test.sh: runs README.md's "Running it yourself" block as written, in order,
# in one shell, and fails if any command in it fails.
#
# The block is taken from the README itself (the first ```sh block after the heading), so the
# README cannot drift from what runs. Its projector uses a database of its own
# (parsley_readme, made afresh), so an earlier run or another test's model "shop" cannot
# interfere; everything else is as a user would have it: config/parsley.toml, the topics
# orders and payments, the gateway on 127.0.0.1:8080. The projector and the gateway the
# block starts in the background are stopped on exit, whatever the outcome.
set -Eeuo pipefail

# shellcheck source=scripts/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
cd "$PARSLEY_ROOT"

README_DATABASE="parsley_readme"
BLOCK_TIMEOUT_S="${README_TEST_TIMEOUT_S:-600}"
LOG="$LOG_DIR/readme-test.log"

readme_say() { printf '[readme-test] %s\n' "$*"; }

block="$(awk '
    /^### Running it yourself/ { in_section = 1; next }
    in_section && /^```sh$/ { in_block = 1; next }
    in_block && /^```$/ { exit }
    in_block { print }
' README.md)"
[ -n "$block" ] || fail "README.md has no \`\`\`sh block under \"### Running it yourself\""
grep -q "parsley-projector -- run" <<<"$block" || fail "the README block no longer starts a projector: update this script"

for port in 8080 9464; do
    if port_open "$port"; then
        fail "127.0.0.1:$port is taken ($(who_listens "$port")): the README's projector and gateway need it"
    fi
done

bash scripts/services.sh up
admin_url="postgres://$PG_USER:$PG_PASSWORD@$PG_HOST:$PG_PORT/postgres"
psql -q "$admin_url" -c "DROP DATABASE IF EXISTS $README_DATABASE WITH (FORCE)" -c "CREATE DATABASE $README_DATABASE"
export PARSLEY_DATABASE_URL="postgres://$PG_USER:$PG_PASSWORD@$PG_HOST:$PG_PORT/$README_DATABASE"
unset DATABASE_URL PARSLEY_CONFIG PARSLEY_TOKEN_KEYS PARSLEY_TOKEN_KEYS_FILE

readme_say "running README.md's \"Running it yourself\" block (log: $LOG)"
printf '%s\n' "$block" | sed 's/^/    /'
mkdir -p "$LOG_DIR"
# The block runs in a shell of its own with job control off, as a pasted script would; the
# `trap` stops what it left running in the background if a command fails.
rc=0
timeout --kill-after=10 "$BLOCK_TIMEOUT_S" bash -c '
    set -Eeuo pipefail
    trap '"'"'rc=$?; jobs -p | xargs -r kill 2>/dev/null; wait; exit $rc'"'"' EXIT
    eval "$1"
' readme-block "$block" >"$LOG" 2>&1 || rc=$?
if [ "$rc" != 0 ]; then
    tail -n 60 "$LOG" >&2
    fail "the README block failed (exit $rc; whole output: $LOG)"
fi
grep -q '"violations":0\|"violations": 0' "$LOG" ||
    { tail -n 40 "$LOG" >&2; fail "the session-guarantee check's summary was not found with 0 violations ($LOG)"; }
readme_say "every command of the block succeeded; the check found 0 violations"
