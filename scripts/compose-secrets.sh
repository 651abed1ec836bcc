#!/usr/bin/env bash
# scripts/compose-secrets.sh [DIR]: the files docker-compose.yml mounts as secrets, made once
# in DIR (default ./secrets; docker-compose.yml reads PARSLEY_SECRETS_DIR, default ./secrets):
#   postgres-password   a random password for the database superuser postgres (the operator's)
#   projector-db-password, gateway-db-password
#                       random passwords for the services' login roles, parsley_projector
#                       and parsley_gateway_login (compose/postgres-roles.sh makes them)
#   database-url        postgres://parsley_projector:<its password>@postgres:5432/parsley
#   gateway-database-url postgres://parsley_gateway_login:<its password>@postgres:5432/parsley
#   token-keys          the gateway's session-token key, compose:<base64 of 32 random bytes>
#   jwt-signing-key.pem a DEVELOPMENT identity provider's Ed25519 private key (PKCS#8), which
#                       `parsley dev-token` signs callers' JWTs with; never mounted into a
#                       service
#   jwks.json           its public key as a JWKS (kid compose-dev), the gateway's
#                       gateway.auth.jwks_file (config/compose.toml)
# An existing file is kept (a new token key would end every session; a new password would
# not match the database already initialised with the old one). The folder is mode 700; the
# files are readable by all (644), since the services read them as their own users.
set -Eeuo pipefail

dir="${1:-secrets}"
umask 022
mkdir -p "$dir"
chmod 0700 "$dir"

make_file() {
    local file="$dir/$1"
    if [ ! -s "$file" ]; then
        printf '%s\n' "$2" >"$file.new"
        chmod 0644 "$file.new"
        mv "$file.new" "$file"
        printf '[compose-secrets] made %s\n' "$file"
    fi
}

random_text() { head -c "$1" /dev/urandom | base64 | tr -d '\n/+='; }

make_file postgres-password "$(random_text 24)"
make_file projector-db-password "$(random_text 24)"
make_file gateway-db-password "$(random_text 24)"
make_file database-url "postgres://parsley_projector:$(tr -d '\n' <"$dir/projector-db-password")@postgres:5432/parsley"
make_file gateway-database-url "postgres://parsley_gateway_login:$(tr -d '\n' <"$dir/gateway-db-password")@postgres:5432/parsley"
make_file token-keys "compose:$(head -c 32 /dev/urandom | base64 | tr -d '\n')"

# The development identity provider: a key pair made here, its public half as the JWKS the
# composed gateway trusts. Replace jwks.json (or gateway.auth) with your provider's for
# anything but development.
if [ ! -s "$dir/jwt-signing-key.pem" ]; then
    command -v openssl >/dev/null 2>&1 || {
        printf '[compose-secrets] openssl is needed to make the development signing key\n' >&2
        exit 1
    }
    (umask 077 && openssl genpkey -algorithm ed25519 -out "$dir/jwt-signing-key.pem.new" 2>/dev/null)
    mv "$dir/jwt-signing-key.pem.new" "$dir/jwt-signing-key.pem"
    rm -f "$dir/jwks.json"
    printf '[compose-secrets] made %s (development only)\n' "$dir/jwt-signing-key.pem"
fi
public_x="$(openssl pkey -in "$dir/jwt-signing-key.pem" -pubout -outform DER | tail -c 32 | base64 | tr '+/' '-_' | tr -d '=\n')"
make_file jwks.json "{\"keys\": [{\"kty\": \"OKP\", \"crv\": \"Ed25519\", \"alg\": \"EdDSA\", \"use\": \"sig\", \"kid\": \"compose-dev\", \"x\": \"$public_x\"}]}"
