#!/bin/bash
# Run once, when the database is initialised (mounted into /docker-entrypoint-initdb.d, run by
# the official postgres image's entry point and by compose/postgres/entrypoint.sh alike): the
# login roles the services use instead of the superuser.
#   parsley_projector      owns the database (so it creates the project's schemas) and may
#                          create roles (`parsley-projector migrate --create-roles` makes
#                          parsley_gateway and each model's read role); not a superuser
#   parsley_gateway_login  the gateway's login; the migrate job grants it parsley_gateway,
#                          which reads what the gateway serves and writes idempotency keys only
# Their passwords come from the secrets compose-secrets.sh made.
set -euo pipefail

psql -v ON_ERROR_STOP=1 \
    -v projector_password="$(cat /run/secrets/projector_db_password)" \
    -v gateway_password="$(cat /run/secrets/gateway_db_password)" \
    -v db="${POSTGRES_DB:-parsley}" >/dev/null <<'SQL'
CREATE ROLE parsley_projector LOGIN NOSUPERUSER CREATEROLE PASSWORD :'projector_password';
CREATE ROLE parsley_gateway_login LOGIN NOSUPERUSER NOCREATEROLE NOCREATEDB PASSWORD :'gateway_password';
ALTER DATABASE :"db" OWNER TO parsley_projector;
SQL
echo "initdb: roles parsley_projector (owner of the database) and parsley_gateway_login made"
