#!/usr/bin/env bash
# `make bench-announce`: what announcing every change costs, with pgbench on a scratch
# database migrated by this build (docs/gateway.md, "Kept snapshots"):
#
# - the `parsley.clock` statement trigger (`clock_edited`, `ENABLE ALWAYS`) a step fires:
#   20 clock upserts per transaction (a step's `parsley.step` mark set, so nothing is
#   notified), with the trigger on and off in alternating rounds;
# - the listener's barrier: `pg_backend_pid()` alone against the barrier as it runs
#   (`store::listen::barrier`: the pid, the announcing triggers that are not `ALWAYS`, and
#   their catalog rows' versions).
#
# Prints the average latency of each, per round (ROUNDS, default 3; RUN_SECONDS per run,
# default 8). The database is dropped at the end.
set -Eeuo pipefail

# shellcheck source=scripts/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
cd "$PARSLEY_ROOT"

ROUNDS="${ROUNDS:-3}"
SECONDS_PER_RUN="${RUN_SECONDS:-8}"
DB="parsley_bench_announce"
command -v pgbench >/dev/null 2>&1 || fail "pgbench not found (Debian's postgresql-client-* has it)"
bash scripts/services.sh up >/dev/null
cargo build -q -p parsley-projector --bin parsley-projector

export PGPASSWORD="$PG_PASSWORD"
conn=(-h "$PG_HOST" -p "$PG_PORT" -U "$PG_USER")
psql "${conn[@]}" -d "$PG_DB" -qc "SET client_min_messages = warning" -c "DROP DATABASE IF EXISTS $DB" -c "CREATE DATABASE $DB"
trap 'psql "${conn[@]}" -d "$PG_DB" -qc "DROP DATABASE IF EXISTS $DB" >/dev/null 2>&1 || true' EXIT
PARSLEY_DATABASE_URL="postgres://$PG_USER:$PG_PASSWORD@$PG_HOST:$PG_PORT/$DB" \
    target/debug/parsley-projector migrate --config config/parsley.toml >/dev/null

work="$(mktemp -d)"
psql "${conn[@]}" -d "$DB" -qc "INSERT INTO parsley.models (model, task_count, format_version) VALUES ('bench', 1, 1)" \
    -c "INSERT INTO parsley.tasks (model, task, epoch, owner) VALUES ('bench', 0, 1, 'bench')"
{
    echo '\set pos random(1, 1000000000)'
    echo 'BEGIN;'
    echo "SELECT set_config('parsley.step', 'on', true);"
    for i in $(seq 1 20); do
        echo "INSERT INTO parsley.clock (model, task, topic_id, partition, position) SELECT 'bench', 0, '00000000-0000-0000-0000-000000000001', p, :pos + $i FROM generate_series(0, 3) p ON CONFLICT (model, task, topic_id, partition) DO UPDATE SET position = EXCLUDED.position;"
    done
    echo 'COMMIT;'
} >"$work/step.sql"
echo 'SELECT pg_backend_pid();' >"$work/pid.sql"
tables="projection.documents,projection.documents,parsley.models,parsley.models,parsley.models,parsley.models,parsley.topics,parsley.topics,parsley.clock,parsley.clock"
triggers="documents_edited,documents_truncated,models_recorded_or_removed,models_reshaped,models_shape_changed,models_truncated,topics_recorded,topics_changed,clock_edited,clock_truncated"
echo "SELECT pg_backend_pid(), coalesce(array_agg(t.tbl || '.' || t.name ORDER BY t.n), '{}'), (SELECT coalesce(string_agg(g.oid::text || '@' || g.xmin::text, ',' ORDER BY g.oid), '') FROM pg_trigger g JOIN unnest('{$tables}'::text[], '{$triggers}'::text[]) AS a(tbl, name) ON g.tgrelid = to_regclass(a.tbl) AND g.tgname = a.name) FROM unnest('{$tables}'::text[], '{$triggers}'::text[]) WITH ORDINALITY AS t(tbl, name, n) WHERE NOT EXISTS (SELECT 1 FROM pg_trigger g WHERE g.tgrelid = to_regclass(t.tbl) AND g.tgname = t.name AND g.tgenabled = 'A');" >"$work/barrier.sql"

latency() { pgbench "${conn[@]}" -n -M prepared -c 1 -T "$SECONDS_PER_RUN" -f "$1" "$DB" | awk '/latency average/ { print $4 }'; }
for round in $(seq 1 "$ROUNDS"); do
    psql "${conn[@]}" -d "$DB" -qc "ALTER TABLE parsley.clock ENABLE ALWAYS TRIGGER clock_edited"
    on="$(latency "$work/step.sql")"
    psql "${conn[@]}" -d "$DB" -qc "ALTER TABLE parsley.clock DISABLE TRIGGER clock_edited"
    off="$(latency "$work/step.sql")"
    pid="$(latency "$work/pid.sql")"
    barrier="$(latency "$work/barrier.sql")"
    printf 'round %s: 20 clock statements per transaction %s ms with the trigger, %s ms without; barrier %s ms, pg_backend_pid() alone %s ms\n' \
        "$round" "$on" "$off" "$barrier" "$pid"
done
rm -rf "$work"
