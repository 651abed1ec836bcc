#!/bin/bash
# Started as root: on an empty data directory, initdb with POSTGRES_USER as the superuser (its
# password from POSTGRES_PASSWORD or the file POSTGRES_PASSWORD_FILE names), create
# POSTGRES_DB and run the scripts in /docker-entrypoint-initdb.d (*.sh sourced, *.sql through
# psql, in name order, against a server listening on its socket only), as the official image
# does; then run the server as the postgres user, listening on every address of the container
# with password (SCRAM) authentication.
set -euo pipefail

user="${POSTGRES_USER:-postgres}"
db="${POSTGRES_DB:-$user}"
as_postgres() { setpriv --reuid=postgres --regid=postgres --init-groups "$@"; }

mkdir -p "$PGDATA"
chown postgres:postgres "$PGDATA"
chmod 0700 "$PGDATA"

if [ ! -s "$PGDATA/PG_VERSION" ]; then
    password="${POSTGRES_PASSWORD:-}"
    if [ -n "${POSTGRES_PASSWORD_FILE:-}" ]; then
        password="$(cat "$POSTGRES_PASSWORD_FILE")"
    fi
    [ -n "$password" ] || { echo "set POSTGRES_PASSWORD or POSTGRES_PASSWORD_FILE" >&2; exit 1; }
    pwfile="$(mktemp)"
    printf '%s\n' "$password" >"$pwfile"
    chown postgres "$pwfile"
    echo "initdb: superuser $user, database $db"
    as_postgres initdb --username="$user" --pwfile="$pwfile" --encoding=UTF8 --locale=C.UTF-8 \
        --auth-local=trust --auth-host=scram-sha-256 -D "$PGDATA" >/dev/null
    rm -f "$pwfile"
    printf "listen_addresses = '*'\n" >>"$PGDATA/postgresql.conf"
    printf 'host all all all scram-sha-256\n' >>"$PGDATA/pg_hba.conf"
    if [ "$db" != postgres ]; then
        printf 'CREATE DATABASE "%s" OWNER "%s";\n' "$db" "$user" |
            as_postgres postgres --single -D "$PGDATA" postgres >/dev/null
    fi
    if compgen -G "/docker-entrypoint-initdb.d/*" >/dev/null; then
        as_postgres pg_ctl -D "$PGDATA" -o "-c listen_addresses=''" -w start >/dev/null
        export POSTGRES_USER="$user" POSTGRES_DB="$db" PGUSER="$user" PGDATABASE="$db" PGHOST=/var/run/postgresql
        for f in /docker-entrypoint-initdb.d/*; do
            case "$f" in
                *.sh) echo "initdb: running $f"; . "$f" ;;
                *.sql) echo "initdb: running $f"; psql -v ON_ERROR_STOP=1 -f "$f" >/dev/null ;;
                *) echo "initdb: ignoring $f" ;;
            esac
        done
        as_postgres pg_ctl -D "$PGDATA" -m fast -w stop >/dev/null
    fi
fi
exec setpriv --reuid=postgres --regid=postgres --init-groups postgres -D "$PGDATA"
