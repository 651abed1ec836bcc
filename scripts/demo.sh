#!/usr/bin/env bash
# `make demo`: start the local stack, then run the main job.
set -Eeuo pipefail

# shellcheck source=scripts/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
cd "$PARSLEY_ROOT"

bash scripts/services.sh up

cat >&2 <<MSG

[demo] Kafka ($KAFKA_BOOTSTRAP) and Postgres ($DATABASE_URL_LOCAL) are running,
[demo] but the demo cannot run yet: the projector and the gateway are not built.
[demo] Nothing was demonstrated.
MSG
exit 1
