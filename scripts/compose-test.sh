#!/usr/bin/env bash
# scripts/compose-test.sh (`make compose-test`): docker-compose.yml really run, with podman and
# podman-compose and images built on this machine (no registry, no Docker engine):
#
#  1. installs what is missing: podman, runc, debootstrap (and catatonit for `init: true`,
#     netavark and aardvark-dns for the network) from Debian; podman-compose and
#     docker-compose 1.29.2 (with `cython<3`) from PyPI into venvs under .local/compose/;
#  2. validates the schema: `docker-compose config -q` of docker-compose.yml alone and merged
#     with compose/podman.override.yml;
#  3. builds the images: a Debian bookworm base (debootstrap, `podman import`; made once),
#     PostgreSQL 15 from Debian's packages, Kafka 4.1.1 from the Maven Central jars, and the
#     project's image from parsley-projector, parsley-gateway and parsley built here by cargo
#     (debug profile; PROFILE=release for the release one), copied in without debug info;
#  4. brings the stack up (secrets made afresh under .local/compose/secrets), runs the
#     read-your-writes session check through the composed gateway (compose/session-check.py),
#     checks that no task is refused;
#  5. restarts the whole stack (`down`, `up`, the volumes kept) and checks that the model
#     resumes without a refusal and that the earlier session's token still reads its writes;
#  6. brings it down and removes its volumes (KEEP=1 leaves it running instead).
#
# Times are printed for each phase and kept in .local/compose/last-timings. FRESH=1 first
# removes the images and the base file system, to measure a build from nothing.
#
# podman is configured through CONTAINERS_CONF and CONTAINERS_STORAGE_CONF files under
# .local/compose/ only (nothing in /etc): the runc runtime (crun refuses this machine's cgroup
# layout), cgroupfs, file events, and the open-file and process limits root may grant here.
# To look at the stack by hand, export the two variables as the script prints them.
set -Eeuo pipefail

# shellcheck source=scripts/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
# shellcheck source=scripts/kafka.sh
source "$PARSLEY_ROOT/scripts/kafka.sh"
cd "$PARSLEY_ROOT"

say() { printf '[compose-test] %s\n' "$*"; }
warn() { printf '[compose-test] WARNING: %s\n' "$*" >&2; }

COMPOSE_HOME="$LOCAL_DIR/compose"
COMPOSE_LOG="$LOG_DIR/compose-test.log"
PROJECT="parsley-compose-test"
FILES=(-f "$PARSLEY_ROOT/docker-compose.yml" -f "$PARSLEY_ROOT/compose/podman.override.yml")
BASE_IMAGE="localhost/parsley-base:bookworm"
ROOTFS="$COMPOSE_HOME/rootfs"
VENV="$COMPOSE_HOME/venv"
LINT_VENV="$COMPOSE_HOME/lint-venv"
PROFILE="${PROFILE:-debug}"
GATEWAY_URL="http://127.0.0.1:18080"
ADMIN_URL="http://127.0.0.1:19091"
START_TIMEOUT=180

export CONTAINERS_CONF="$COMPOSE_HOME/containers.conf"
export CONTAINERS_STORAGE_CONF="$COMPOSE_HOME/storage.conf"
export PARSLEY_SECRETS_DIR="$COMPOSE_HOME/secrets"
export PARSLEY_GATEWAY_PORT=18080 PARSLEY_METRICS_PORT=19464

TIMINGS=()
# timed NAME COMMAND...: runs the command, records and prints how long it took.
timed() {
    local name="$1" t0 t1 took
    shift
    t0="$(date +%s%N)"
    "$@"
    t1="$(date +%s%N)"
    took="$(((t1 - t0) / 1000000000)).$((((t1 - t0) / 100000000) % 10))"
    TIMINGS+=("$name=$took")
    say "$name: ${took} s"
}

# ---- 1. prerequisites ----

write_podman_config() {
    mkdir -p "$COMPOSE_HOME/storage" "$COMPOSE_HOME/runroot"
    cat >"$CONTAINERS_CONF" <<EOF
# Written by scripts/compose-test.sh. Root cannot raise the open-file limit past 20000 nor the
# process limit past 32768 on these machines; crun refuses their cgroup layout, runc does not.
[containers]
default_ulimits = ["nofile=20000:20000", "nproc=32768:32768"]
[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "file"
[network]
network_backend = "netavark"
EOF
    cat >"$CONTAINERS_STORAGE_CONF" <<EOF
# Written by scripts/compose-test.sh: images, containers and volumes of the compose test.
[storage]
driver = "overlay"
graphroot = "$COMPOSE_HOME/storage"
runroot = "$COMPOSE_HOME/runroot"
EOF
}

install_prerequisites() {
    local need=() tool
    for tool in podman runc debootstrap; do
        command -v "$tool" >/dev/null 2>&1 || need+=("$tool")
    done
    [ -x /usr/libexec/podman/catatonit ] || need+=(catatonit)
    [ -x /usr/lib/podman/netavark ] || need+=(netavark)
    [ -x /usr/lib/podman/aardvark-dns ] || need+=(aardvark-dns)
    command -v iptables >/dev/null 2>&1 || need+=(iptables)
    if [ "${#need[@]}" -gt 0 ]; then
        apt_install "${need[@]}"
    fi
    # Java 17 and Maven (and the broker's jars in the Maven repository), as the local broker.
    kafka_install
    if [ ! -x "$VENV/bin/podman-compose" ]; then
        say "pip install podman-compose into $VENV"
        python3 -m venv "$VENV"
        "$VENV/bin/pip" install -q podman-compose >>"$COMPOSE_LOG" 2>&1 ||
            fail "pip install podman-compose failed" "$COMPOSE_LOG"
    fi
    if [ ! -x "$LINT_VENV/bin/docker-compose" ]; then
        say "pip install docker-compose==1.29.2 (cython<3) into $LINT_VENV"
        python3 -m venv "$LINT_VENV"
        printf 'cython<3\n' >"$COMPOSE_HOME/pip-constraints.txt"
        PIP_CONSTRAINT="$COMPOSE_HOME/pip-constraints.txt" "$LINT_VENV/bin/pip" install -q docker-compose==1.29.2 \
            >>"$COMPOSE_LOG" 2>&1 || fail "pip install docker-compose==1.29.2 failed" "$COMPOSE_LOG"
    fi
    write_podman_config
}

compose() { "$VENV/bin/podman-compose" -p "$PROJECT" "${FILES[@]}" "$@"; }

# ---- 2. schema ----

validate() {
    local lint="$LINT_VENV/bin/docker-compose"
    "$lint" -f docker-compose.yml config -q || fail "docker-compose config -q: docker-compose.yml is not valid"
    "$lint" "${FILES[@]}" config -q ||
        fail "docker-compose config -q: docker-compose.yml with compose/podman.override.yml is not valid"
    say "docker-compose config -q: docker-compose.yml and the merged override are valid"
}

# ---- 3. images ----

fresh_start() {
    say "FRESH=1: removing the compose test's images and base file system"
    compose down -v >>"$COMPOSE_LOG" 2>&1 || true
    podman rmi -f localhost/parsley:compose localhost/parsley-kafka:4.1.1 localhost/parsley-postgres:15 \
        "$BASE_IMAGE" >>"$COMPOSE_LOG" 2>&1 || true
    podman image prune -f >>"$COMPOSE_LOG" 2>&1 || true
    rm -rf "$ROOTFS"
}

# The base image: Debian bookworm minbase from debootstrap, with the updates and security
# suites, imported as an image. Made once; FRESH=1 makes it again.
base_image() {
    if podman image exists "$BASE_IMAGE"; then
        say "base image $BASE_IMAGE exists"
        return 0
    fi
    if [ ! -x "$ROOTFS/bin/bash" ]; then
        rm -rf "$ROOTFS"
        say "debootstrap --variant=minbase bookworm (log: $COMPOSE_LOG)"
        debootstrap --variant=minbase bookworm "$ROOTFS" http://deb.debian.org/debian >>"$COMPOSE_LOG" 2>&1 ||
            fail "debootstrap failed" "$COMPOSE_LOG"
    fi
    cat >"$ROOTFS/etc/apt/sources.list" <<'EOF'
deb http://deb.debian.org/debian bookworm main
deb http://deb.debian.org/debian bookworm-updates main
deb http://deb.debian.org/debian-security bookworm-security main
EOF
    rm -f "$ROOTFS"/var/cache/apt/archives/*.deb
    rm -rf "$ROOTFS"/var/lib/apt/lists/*
    tar -C "$ROOTFS" -c . | podman import --change 'CMD ["/bin/bash"]' - "$BASE_IMAGE" >>"$COMPOSE_LOG" 2>&1 ||
        fail "podman import of the base file system failed" "$COMPOSE_LOG"
    say "base image $BASE_IMAGE imported"
}

build() {
    local image="$1" context="$2"
    podman build --network host --build-arg BASE="$BASE_IMAGE" -t "$image" -f "$context/Containerfile" "$context" \
        >>"$COMPOSE_LOG" 2>&1 || fail "podman build $image failed" "$COMPOSE_LOG"
}

postgres_image() { build localhost/parsley-postgres:15 "$PARSLEY_ROOT/compose/postgres"; }

# The broker's class path with the tools (kafka-topics), resolved by Maven from the local
# repository scripts/kafka.sh filled (only kafka-tools and what it adds are downloaded).
kafka_image() {
    local context="$COMPOSE_HOME/build/kafka" libs="$COMPOSE_HOME/kafka-libs"
    local marker="$libs/.complete-$KAFKA_VERSION"
    if [ ! -f "$marker" ]; then
        rm -rf "$libs"
        mkdir -p "$libs"
        cat >"$COMPOSE_HOME/kafka-pom.xml" <<EOF
<?xml version="1.0" encoding="UTF-8"?>
<!-- Generated by scripts/compose-test.sh: the class path of the compose test's broker image. -->
<project xmlns="http://maven.apache.org/POM/4.0.0">
  <modelVersion>4.0.0</modelVersion>
  <groupId>local.parsley</groupId>
  <artifactId>kafka-image-classpath</artifactId>
  <version>0</version>
  <packaging>pom</packaging>
  <dependencies>
    <dependency><groupId>org.apache.kafka</groupId><artifactId>kafka_2.13</artifactId><version>$KAFKA_VERSION</version></dependency>
    <dependency><groupId>org.apache.kafka</groupId><artifactId>kafka-tools</artifactId><version>$KAFKA_VERSION</version></dependency>
    <dependency><groupId>org.apache.logging.log4j</groupId><artifactId>log4j-slf4j-impl</artifactId><version>$LOG4J_VERSION</version></dependency>
  </dependencies>
  <build><pluginManagement><plugins><plugin>
    <groupId>org.apache.maven.plugins</groupId><artifactId>maven-dependency-plugin</artifactId><version>3.8.1</version>
  </plugin></plugins></pluginManagement></build>
</project>
EOF
        timeout 900 mvn -B -f "$COMPOSE_HOME/kafka-pom.xml" dependency:copy-dependencies -DincludeScope=runtime \
            -DoutputDirectory="$libs" </dev/null >>"$COMPOSE_LOG" 2>&1 ||
            fail "Maven could not fetch the Kafka $KAFKA_VERSION jars with the tools" "$COMPOSE_LOG"
        touch "$marker"
    fi
    rm -rf "$context"
    mkdir -p "$context"
    cp "$PARSLEY_ROOT"/compose/kafka/* "$context/"
    cp -al "$libs" "$context/libs"
    rm -f "$context/libs/.complete-"*
    build localhost/parsley-kafka:4.1.1 "$context"
}

cargo_build() {
    if ! command -v cargo >/dev/null 2>&1 && [ -x "$HOME/.cargo/bin/cargo" ]; then
        export PATH="$HOME/.cargo/bin:$PATH"
    fi
    local flags=()
    [ "$PROFILE" = release ] && flags+=(--release)
    cargo build -q "${flags[@]}" -p parsley-projector -p parsley-gateway -p parsley-cli ||
        fail "cargo build of parsley-projector, parsley-gateway and parsley failed"
}

parsley_image() {
    local context="$COMPOSE_HOME/build/parsley" bin
    bin="${CARGO_TARGET_DIR:-$PARSLEY_ROOT/target}/$PROFILE"
    rm -rf "$context"
    mkdir -p "$context/bin"
    cp "$PARSLEY_ROOT/compose/parsley/Containerfile" "$context/"
    cp -r "$PARSLEY_ROOT/config" "$context/config"
    local name
    for name in parsley-projector parsley-gateway parsley; do
        objcopy --strip-debug "$bin/$name" "$context/bin/$name" || fail "copying $bin/$name failed"
    done
    build localhost/parsley:compose "$context"
}

# ---- 4.-6. the stack ----

dump_logs() {
    local container
    for container in $(podman ps -a --filter "label=io.podman.compose.project=$PROJECT" --format '{{.Names}}'); do
        printf '[compose-test] ---- last 30 lines of %s ----\n' "$container" >&2
        podman logs --tail 30 "$container" >&2 2>&1 || true
    done
}

on_exit() {
    local rc=$?
    if [ "$rc" != 0 ]; then
        dump_logs
        if [ "${KEEP:-0}" = 1 ]; then
            say "KEEP=1: the stack is left as it is"
        else
            say "bringing the stack down after the failure (volumes removed)"
            compose down -v >>"$COMPOSE_LOG" 2>&1 || true
        fi
    fi
}

wait_port() {
    local port="$1" what="$2" deadline=$(($(now_s) + START_TIMEOUT))
    until port_open "$port"; do
        [ "$(now_s)" -lt "$deadline" ] || fail "$what does not answer on 127.0.0.1:$port after ${START_TIMEOUT}s"
        sleep 0.5
    done
}

# The services' database roles are not superusers, and the gateway's login holds
# parsley_gateway (made by the migrate job), nothing more.
check_roles() {
    local roles
    roles="$(podman exec "${PROJECT}_postgres_1" psql -U postgres -d parsley -tAc \
        "SELECT string_agg(rolname || ':' || rolsuper, ',' ORDER BY rolname) FROM pg_roles
          WHERE rolname IN ('parsley_projector', 'parsley_gateway_login', 'parsley_gateway')")"
    [ "$roles" = "parsley_gateway:false,parsley_gateway_login:false,parsley_projector:false" ] ||
        fail "the services' roles are not the expected non-superusers: $roles"
    podman exec "${PROJECT}_postgres_1" psql -U postgres -d parsley -tAc \
        "SELECT pg_has_role('parsley_gateway_login', 'parsley_gateway', 'MEMBER')" | grep -qx t ||
        fail "parsley_gateway_login was not granted parsley_gateway"
    say "roles: parsley_projector and parsley_gateway_login, neither a superuser"
}

# The stack in dependency order: podman-compose neither runs healthchecks nor waits for them.
stack_up() {
    local t0 t1 t2 rc
    t0="$(now_s)"
    compose up -d --no-build --no-deps kafka postgres >>"$COMPOSE_LOG" 2>&1 || fail "podman-compose up kafka postgres failed" "$COMPOSE_LOG"
    wait_port 15432 PostgreSQL
    wait_port 19092 Kafka
    t1="$(now_s)"
    compose up -d --no-build --no-deps topics migrate >>"$COMPOSE_LOG" 2>&1 ||
        fail "podman-compose up topics migrate failed" "$COMPOSE_LOG"
    rc="$(podman wait "${PROJECT}_topics_1")"
    [ "$rc" = 0 ] || fail "the topics job exited with status $rc"
    rc="$(podman wait "${PROJECT}_migrate_1")"
    [ "$rc" = 0 ] || fail "the migrate job exited with status $rc: $(podman logs "${PROJECT}_migrate_1" 2>&1 | tail -n 5)"
    check_roles
    t2="$(now_s)"
    compose up -d --no-build --no-deps projector gateway >>"$COMPOSE_LOG" 2>&1 ||
        fail "podman-compose up projector gateway failed" "$COMPOSE_LOG"
    python3 compose/session-check.py ready --gateway "$GATEWAY_URL" --admin "$ADMIN_URL" --timeout "$START_TIMEOUT"
    say "Kafka and PostgreSQL answering: $((t1 - t0)) s; the topics job: $((t2 - t1)) s; projector and gateway ready: $(($(now_s) - t2)) s"
}

stack_down() {
    local flags=()
    [ "${1:-}" = volumes ] && flags+=(-v)
    compose down "${flags[@]}" >>"$COMPOSE_LOG" 2>&1 || fail "podman-compose down failed" "$COMPOSE_LOG"
}

# A development JWT for SUBJECT, signed with the key pair compose-secrets.sh made (the JWKS
# the composed gateway trusts), by the CLI built on the host: what README.md tells users.
dev_token() {
    local bin="${CARGO_TARGET_DIR:-$PARSLEY_ROOT/target}/$PROFILE/parsley"
    "$bin" dev-token --key "$PARSLEY_SECRETS_DIR/jwt-signing-key.pem" --kid compose-dev \
        --iss https://dev.parsley.invalid --aud parsley --sub "$1" || fail "parsley dev-token failed"
}

SUBJECT="compose-$(date +%s)"

check_write() {
    python3 compose/session-check.py write --gateway "$GATEWAY_URL" --state "$COMPOSE_HOME/session.json" \
        --subject "$SUBJECT" --bearer "$(dev_token "$SUBJECT")"
    python3 compose/session-check.py status --admin "$ADMIN_URL"
}

check_resume() {
    python3 compose/session-check.py resume --gateway "$GATEWAY_URL" --state "$COMPOSE_HOME/session.json" \
        --bearer "$(dev_token "$SUBJECT")"
    python3 compose/session-check.py status --admin "$ADMIN_URL"
}

main() {
    [ "$(id -u)" = 0 ] || fail "run as root: podman here runs rootful, with its storage under .local/compose"
    mkdir -p "$COMPOSE_HOME" "$LOG_DIR"
    printf '\n==== %s make compose-test ====\n' "$(date -Is)" >>"$COMPOSE_LOG"
    say "log: $COMPOSE_LOG"
    timed install install_prerequisites
    say "podman: export CONTAINERS_CONF=$CONTAINERS_CONF CONTAINERS_STORAGE_CONF=$CONTAINERS_STORAGE_CONF"
    timed validate validate
    trap on_exit EXIT
    compose down -v >>"$COMPOSE_LOG" 2>&1 || true
    [ "${FRESH:-0}" = 1 ] && fresh_start
    timed cargo_build cargo_build
    timed image_base base_image
    timed image_postgres postgres_image
    timed image_kafka kafka_image
    timed image_parsley parsley_image
    rm -rf "$PARSLEY_SECRETS_DIR"
    bash scripts/compose-secrets.sh "$PARSLEY_SECRETS_DIR" >/dev/null
    timed start stack_up
    timed check check_write
    timed down stack_down
    timed restart stack_up
    timed check_after_restart check_resume
    if [ "${KEEP:-0}" = 1 ]; then
        say "KEEP=1: the stack stays up (gateway $GATEWAY_URL, admin $ADMIN_URL); stop it with"
        say "  CONTAINERS_CONF=$CONTAINERS_CONF CONTAINERS_STORAGE_CONF=$CONTAINERS_STORAGE_CONF \\"
        say "  $VENV/bin/podman-compose -p $PROJECT ${FILES[*]} down -v"
    else
        timed down_volumes stack_down volumes
    fi
    printf '%s\n' "${TIMINGS[@]}" >"$COMPOSE_HOME/last-timings"
    say "passed; times (s): ${TIMINGS[*]}"
}

main "$@"
