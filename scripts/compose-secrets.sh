#!/usr/bin/env bash
# scripts/compose-secrets.sh [DIR]: the files docker-compose.yml mounts as secrets, made once
# in DIR (default ./secrets; docker-compose.yml reads PARSLEY_SECRETS_DIR, default ./secrets):
#   postgres-password   a random password for the database user parsley
#   database-url        postgres://parsley:<that password>@postgres:5432/parsley
#   token-keys          the gateway's session-token key, compose:<base64 of 32 random bytes>
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
make_file database-url "postgres://parsley:$(tr -d '\n' <"$dir/postgres-password")@postgres:5432/parsley"
make_file token-keys "compose:$(head -c 32 /dev/urandom | base64 | tr -d '\n')"
