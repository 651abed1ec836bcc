#!/usr/bin/env bash
# The TypeScript client's tests (clients/typescript, `node --test`): its unit tests, then its
# tests against a real gateway and projector started by scripts/api-stack.sh. Needs Node 18+.
set -Eeuo pipefail

# shellcheck source=scripts/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
cd "$PARSLEY_ROOT"

command -v node >/dev/null 2>&1 || fail "node not found: the TypeScript client's tests need Node 18 or later"
# The declarations type-checked against their uses (test/types.ts) by the TypeScript compiler
# pinned in package-lock.json, installed from npm into clients/typescript/node_modules.
(cd clients/typescript && npm ci --no-audit --no-fund --loglevel=error) || fail "installing the TypeScript compiler from npm failed"
(cd clients/typescript && node_modules/.bin/tsc --noEmit -p .) || fail "the TypeScript client's declarations do not type-check (npm run typecheck)"
node --test clients/typescript/test/unit.test.js
if [ -n "${PARSLEY_API_URL:-}" ]; then
    # Already inside scripts/api-stack.sh (`make test` runs these and the fuzzer on one stack).
    node --test clients/typescript/test/gateway.test.js
else
    bash scripts/api-stack.sh node --test clients/typescript/test/gateway.test.js
fi
