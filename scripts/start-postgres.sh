#!/usr/bin/env bash
# Starts a throwaway PostgreSQL 15 for the orchestrator tests and benchmarks (idempotent).
#
#   eval "$(scripts/start-postgres.sh)"            # data under ${TMPDIR:-/tmp}/reach-postgres, port 5433
#   eval "$(scripts/start-postgres.sh DIR PORT)"
#   scripts/start-postgres.sh --stop [DIR]
#
# Prints one line to stdout: export REACH_TEST_POSTGRES_URL=postgres://postgres@127.0.0.1:PORT/postgres
# Everything else goes to stderr. Installs PostgreSQL with apt-get when it is missing.
set -euo pipefail

BIN=/usr/lib/postgresql/15/bin
if [[ "${1:-}" == "--stop" ]]; then
  DIR="${2:-${TMPDIR:-/tmp}/reach-postgres}"
  if [[ -f "$DIR/data/postmaster.pid" ]]; then
    runuser -u postgres -- "$BIN/pg_ctl" -D "$DIR/data" -m fast -w stop >&2
  fi
  exit 0
fi
DIR="${1:-${TMPDIR:-/tmp}/reach-postgres}"
PORT="${2:-5433}"

if [[ ! -x "$BIN/initdb" ]]; then
  echo "installing postgresql (apt-get)" >&2
  DEBIAN_FRONTEND=noninteractive apt-get update -qq >&2
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql >&2
fi

# initdb and the server refuse to run as root: run them as the postgres user.
as_pg() {
  if [[ "$(id -u)" == "0" ]]; then runuser -u postgres -- "$@"; else "$@"; fi
}

if [[ "$(id -u)" == "0" ]]; then install -d -o postgres "$DIR"; else mkdir -p "$DIR"; fi
if [[ ! -f "$DIR/data/PG_VERSION" ]]; then
  as_pg "$BIN/initdb" -D "$DIR/data" -A trust -U postgres >&2
fi
if as_pg "$BIN/pg_ctl" -D "$DIR/data" status >/dev/null 2>&1; then
  echo "postgresql already running in $DIR/data" >&2
else
  as_pg "$BIN/pg_ctl" -D "$DIR/data" \
    -o "-c listen_addresses=127.0.0.1 -p $PORT -k $DIR -c max_connections=300 -c fsync=on" \
    -l "$DIR/log" -w start >&2
fi
echo "export REACH_TEST_POSTGRES_URL=postgres://postgres@127.0.0.1:$PORT/postgres"
