# Shared settings and helpers for the local-stack scripts. Sourced, not run.
# shellcheck shell=bash
# shellcheck disable=SC2034  # the settings below are used by the scripts that source this file

# Repository root: the parent of this scripts/ folder, wherever the clone lives.
PARSLEY_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
LOCAL_DIR="$PARSLEY_ROOT/.local"
LOG_DIR="$LOCAL_DIR/logs"
RUN_DIR="$LOCAL_DIR/run"

# ---- pinned versions and fixed addresses (see docs/development.md) ----
KAFKA_VERSION="4.1.1"      # org.apache.kafka:kafka_2.13 from Maven Central
LOG4J_VERSION="2.24.3"     # the log4j2 line Kafka $KAFKA_VERSION is built against
KAFKA_HOST="127.0.0.1"
KAFKA_PORT=9092
KAFKA_CONTROLLER_PORT=9093
PG_HOST="127.0.0.1"
PG_PORT=5432
PG_DB="parsley"
PG_USER="parsley"
PG_PASSWORD="parsley"
READY_TIMEOUT="${PARSLEY_READY_TIMEOUT:-120}"   # seconds to wait for a service to answer

KAFKA_BOOTSTRAP="$KAFKA_HOST:$KAFKA_PORT"
DATABASE_URL_LOCAL="postgres://$PG_USER:$PG_PASSWORD@$PG_HOST:$PG_PORT/$PG_DB"

# ---- output ----
say() { printf '[services] %s\n' "$*"; }
warn() { printf '[services] WARNING: %s\n' "$*" >&2; }

# fail MESSAGE [LOG_FILE...]: print the message and the tail of each log, exit 1.
fail() {
    local msg="$1"
    shift
    printf '[services] ERROR: %s\n' "$msg" >&2
    local f
    for f in "$@"; do
        if [ -s "$f" ]; then
            printf '[services] ---- last 40 lines of %s ----\n' "$f" >&2
            tail -n 40 "$f" >&2
            printf '[services] ---- end of %s ----\n' "$f" >&2
        fi
    done
    exit 1
}

now_s() { date +%s; }

# Any command failing where no check expected it: say where, instead of exiting silently.
# (Scripts that source this file use `set -Eeuo pipefail`, so the trap reaches functions.)
trap 'fail "unexpected failure (exit $?) at ${BASH_SOURCE[0]}:$LINENO: $BASH_COMMAND"' ERR

# port_open PORT: true if something accepts TCP connections on 127.0.0.1:PORT.
port_open() {
    (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null
}

# who_listens PORT: a best-effort description of the process listening on PORT.
who_listens() {
    if command -v ss >/dev/null 2>&1; then
        ss -ltnpH "sport = :$1" 2>/dev/null | sed 's/^/    /'
    fi
}

# apt_install PACKAGE...: install Debian packages (apt-get update once per run).
APT_UPDATED=0
apt_install() {
    command -v apt-get >/dev/null 2>&1 ||
        fail "need Debian packages ($*) but apt-get is not available; install them by hand"
    [ "$(id -u)" = 0 ] || fail "need Debian packages ($*): run as root or install them by hand"
    mkdir -p "$LOG_DIR"
    local log="$LOG_DIR/apt.log"
    if [ "$APT_UPDATED" = 0 ]; then
        say "apt-get update (log: $log)"
        timeout 600 apt-get update >>"$log" 2>&1 || fail "apt-get update failed" "$log"
        APT_UPDATED=1
    fi
    say "apt-get install -y $* (log: $log)"
    DEBIAN_FRONTEND=noninteractive timeout 900 apt-get install -y --no-install-recommends \
        -o Dpkg::Options::=--force-confold "$@" >>"$log" 2>&1 ||
        fail "apt-get install $* failed" "$log"
}

# pid_alive PIDFILE: true if the pid file names a live process.
pid_alive() {
    local pid
    [ -s "$1" ] || return 1
    pid="$(cat "$1")"
    [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null
}

# terminate TAG NAME PID [TIMEOUT_S]: stops a process: SIGTERM (and SIGCONT, should it be
# frozen), up to TIMEOUT_S seconds (default 20) to exit, then SIGKILL with a warning; reaps it
# when it is this shell's child. An empty PID or a process already gone is nothing to do.
terminate() {
    local tag="$1" name="$2" pid="$3" timeout="${4:-20}" waited=0
    [ -n "$pid" ] || return 0
    if alive "$pid"; then
        kill -TERM "$pid" 2>/dev/null || true
        kill -CONT "$pid" 2>/dev/null || true
        while alive "$pid" && [ "$waited" -lt $((timeout * 10)) ]; do
            sleep 0.1
            waited=$((waited + 1))
        done
        if alive "$pid"; then
            printf '[%s] WARNING: %s (pid %s) did not stop within %ss of SIGTERM; killing it\n' \
                "$tag" "$name" "$pid" "$timeout" >&2
            kill -KILL "$pid" 2>/dev/null || true
        fi
    fi
    wait "$pid" 2>/dev/null || true
}

# fail_showing TAG MESSAGE LOG...: says what failed and shows the last 30 lines of each log
# that has any, then exits 1 (the caller's EXIT trap, if any, stops what it started).
fail_showing() {
    local tag="$1" msg="$2" f
    shift 2
    printf '[%s] FAILED: %s\n' "$tag" "$msg" >&2
    for f in "$@"; do
        if [ -s "$f" ]; then
            printf '[%s] ---- last 30 lines of %s ----\n' "$tag" "$f" >&2
            tail -n 30 "$f" >&2
            printf '[%s] ---- end of %s ----\n' "$tag" "$f" >&2
        fi
    done
    exit 1
}

# alive PID: the process exists and is not a zombie waiting to be reaped.
alive() {
    local state=""
    [ -r "/proc/$1/stat" ] || return 1
    state="$(sed 's/^.*) //' "/proc/$1/stat" 2>/dev/null | cut -d' ' -f1)" || return 1
    [ -n "$state" ] && [ "$state" != Z ]
}

# running_binary PIDFILE BINARY: prints the pid if the file names a live process of BINARY
# (a pid reused by another program is not it).
running_binary() {
    local pidfile="$1" binary="$2" pid
    [ -s "$pidfile" ] || return 1
    pid="$(cat "$pidfile")"
    alive "$pid" || return 1
    tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null | grep -q -- "$binary" || return 1
    echo "$pid"
}

# stop_binary TAG PIDFILE BINARY [TIMEOUT_S]: stops the BINARY process the file names, if it
# runs (terminate), and removes the file.
stop_binary() {
    local tag="$1" pidfile="$2" binary="$3" timeout="${4:-20}" pid
    if pid="$(running_binary "$pidfile" "$binary")"; then
        terminate "$tag" "$binary" "$pid" "$timeout"
        printf '[%s] stopped %s (pid %s)\n' "$tag" "$binary" "$pid"
    fi
    rm -f "$pidfile"
}

# kept_secret FILE BYTES: a random secret kept in FILE (mode 600), made once.
kept_secret() {
    local file="$1" bytes="$2"
    if [ ! -s "$file" ]; then
        (umask 077 && head -c "$bytes" /dev/urandom | base64 | tr -d '\n/+=' >"$file")
    fi
}

# token_keys_file FILE KEY_ID: a gateway token key ring of one random key (KEY_ID:base64),
# kept in FILE (mode 600), made once, so tokens stay valid across restarts.
token_keys_file() {
    local file="$1" id="$2"
    if [ ! -s "$file" ]; then
        (umask 077 && printf '%s:%s\n' "$id" "$(head -c 32 /dev/urandom | base64 | tr -d '\n')" >"$file")
    fi
}

# local_binaries_env CONFIG DATABASE: the environment a projector and a gateway started by hand
# run in (make up, make example): CONFIG, the local broker, DATABASE on the local server, no
# token keys or DATABASE_URL inherited from the caller's shell, no colours in the logs.
local_binaries_env() {
    export PARSLEY_CONFIG="$1"
    export PARSLEY_KAFKA_BOOTSTRAP="$KAFKA_BOOTSTRAP"
    export PARSLEY_DATABASE_URL="postgres://$PG_USER:$PG_PASSWORD@$PG_HOST:$PG_PORT/$2"
    unset PARSLEY_TOKEN_KEYS DATABASE_URL
    export NO_COLOR=1
}
