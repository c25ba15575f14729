#!/usr/bin/env bash
# Starts and stops the real servers the tests, examples and kvbench use, on
# loopback ports of our own, and writes their coordinates to .services/env:
#
#   scripts/services.sh start    # install what is missing, start everything
#   scripts/services.sh stop     # stop what `start` started (by PID)
#   scripts/services.sh status   # one line per server; exit 3 if one is down or none runs
#   source .services/env         # KVTIER_* and AWS_* variables for the servers
#
# Servers: a Redis single node (KVTIER_REDIS_PORT, default 16379), the same
# with TLS on a certificate made here (16380), a 3-master Redis Cluster
# (17001-17003), and an S3 server, s3s-fs (19000) when S3 is enabled.
# Installs: redis-server / redis-tools with apt when missing; s3s-fs with
# `cargo install --locked` at the pinned version when missing.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
STATE="$ROOT/.services"
REDIS_PORT=${KVTIER_REDIS_PORT:-16379}
REDIS_TLS_PORT=${KVTIER_REDIS_TLS_PORT:-16380}
CLUSTER_PORTS=(${KVTIER_CLUSTER_PORTS:-17001 17002 17003})
S3_PORT=${KVTIER_S3_PORT:-19000}
S3S_VERSION=0.14.1
S3_ACCESS_KEY=kvtier-test-access
S3_SECRET_KEY=kvtier-test-secret-0123456789
S3_BUCKET=kvtier-test
WITH_S3=${KVTIER_WITH_S3:-auto}

log() { printf 'services: %s\n' "$*" >&2; }

install_redis() {
  if command -v redis-server >/dev/null && command -v redis-cli >/dev/null && command -v redis-benchmark >/dev/null; then
    return
  fi
  log "installing redis-server and redis-tools with apt"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq redis-server redis-tools >/dev/null
}

wait_for_redis() { # port [tls args...]
  local port=$1; shift
  for _ in $(seq 1 100); do
    if redis-cli -p "$port" "$@" ping 2>/dev/null | grep -q PONG; then return 0; fi
    sleep 0.1
  done
  log "redis on port $port did not answer"; return 1
}

start_redis() { # name port [extra args...]
  local name=$1 port=$2; shift 2
  local dir="$STATE/$name"
  mkdir -p "$dir"
  if [ -f "$dir/pid" ] && kill -0 "$(cat "$dir/pid")" 2>/dev/null; then
    log "$name already running (pid $(cat "$dir/pid"))"
    # kvbench w3 pins the servers to one CPU for a while and puts them back;
    # if it was killed meanwhile, this undoes it.
    if command -v taskset >/dev/null; then
      taskset -a -p "$(taskset -p $$ | sed 's/.*: //')" "$(cat "$dir/pid")" >/dev/null 2>&1 || true
    fi
    return
  fi
  redis-server --bind 127.0.0.1 --port "$port" --dir "$dir" --save "" --appendonly no \
    --daemonize yes --pidfile "$dir/pid" --logfile "$dir/log" "$@"
}

make_tls_cert() {
  local dir="$STATE/tls"
  [ -f "$dir/server.crt" ] && return
  mkdir -p "$dir"
  openssl req -x509 -newkey rsa:2048 -nodes -days 2 -subj "/CN=kvtier-test-ca" \
    -keyout "$dir/ca.key" -out "$dir/ca.crt" 2>/dev/null
  openssl req -newkey rsa:2048 -nodes -subj "/CN=localhost" \
    -keyout "$dir/server.key" -out "$dir/server.csr" 2>/dev/null
  printf 'subjectAltName=DNS:localhost,IP:127.0.0.1\n' > "$dir/ext.cnf"
  openssl x509 -req -in "$dir/server.csr" -CA "$dir/ca.crt" -CAkey "$dir/ca.key" -CAcreateserial \
    -days 2 -extfile "$dir/ext.cnf" -out "$dir/server.crt" 2>/dev/null
}

start_cluster() {
  for port in "${CLUSTER_PORTS[@]}"; do
    start_redis "cluster-$port" "$port" --cluster-enabled yes --cluster-config-file "nodes-$port.conf" \
      --cluster-node-timeout 2000
  done
  for port in "${CLUSTER_PORTS[@]}"; do wait_for_redis "$port"; done
  if ! redis-cli -p "${CLUSTER_PORTS[0]}" cluster info | grep -q 'cluster_state:ok'; then
    local nodes=()
    for port in "${CLUSTER_PORTS[@]}"; do nodes+=("127.0.0.1:$port"); done
    redis-cli --cluster create "${nodes[@]}" --cluster-replicas 0 --cluster-yes >"$STATE/cluster-create.log" 2>&1
  fi
  for _ in $(seq 1 100); do
    if redis-cli -p "${CLUSTER_PORTS[0]}" cluster info | grep -q 'cluster_state:ok'; then return 0; fi
    sleep 0.1
  done
  log "cluster did not reach cluster_state:ok"; return 1
}

s3s_bin() {
  if command -v s3s-fs >/dev/null; then command -v s3s-fs; return; fi
  local cargo_bin="${CARGO_HOME:-$HOME/.cargo}/bin/s3s-fs"
  if [ -x "$cargo_bin" ]; then echo "$cargo_bin"; return; fi
  return 1
}

install_s3s() {
  if s3s_bin >/dev/null; then return; fi
  log "installing s3s-fs $S3S_VERSION with cargo install (a few minutes, once per machine)"
  cargo install "s3s-fs@$S3S_VERSION" --locked --features binary >"$STATE/s3s-install.log" 2>&1 || {
    log "cargo install s3s-fs failed; see $STATE/s3s-install.log"; return 1; }
}

start_s3() {
  local dir="$STATE/s3"
  mkdir -p "$dir/data/$S3_BUCKET"
  if [ -f "$dir/pid" ] && kill -0 "$(cat "$dir/pid")" 2>/dev/null; then
    log "s3s-fs already running (pid $(cat "$dir/pid"))"; return
  fi
  local bin; bin=$(s3s_bin)
  nohup "$bin" --host 127.0.0.1 --port "$S3_PORT" --access-key "$S3_ACCESS_KEY" --secret-key "$S3_SECRET_KEY" \
    "$dir/data" >"$dir/log" 2>&1 &
  echo $! >"$dir/pid"
  for _ in $(seq 1 100); do
    if (exec 3<>"/dev/tcp/127.0.0.1/$S3_PORT") 2>/dev/null; then return 0; fi
    sleep 0.1
  done
  log "s3s-fs did not listen on $S3_PORT; see $dir/log"; return 1
}

write_env() {
  {
    echo "export KVTIER_REDIS_URL=redis://127.0.0.1:$REDIS_PORT/"
    echo "export KVTIER_REDIS_TLS_URL=rediss://localhost:$REDIS_TLS_PORT/"
    echo "export KVTIER_REDIS_TLS_CA=$STATE/tls/ca.crt"
    local urls=()
    for port in "${CLUSTER_PORTS[@]}"; do urls+=("redis://127.0.0.1:$port/"); done
    (IFS=,; echo "export KVTIER_REDIS_CLUSTER_URLS=${urls[*]}")
    echo "export KVTIER_REDIS_PIDFILE=$STATE/redis/pid"
    echo "export KVTIER_REDIS_CLUSTER_PIDDIR=$STATE"
    if [ -f "$STATE/s3/pid" ]; then
      echo "export KVTIER_S3_ENDPOINT=http://127.0.0.1:$S3_PORT"
      echo "export KVTIER_S3_BUCKET=$S3_BUCKET"
      echo "export KVTIER_S3_PIDFILE=$STATE/s3/pid"
      echo "export AWS_ACCESS_KEY_ID=$S3_ACCESS_KEY"
      echo "export AWS_SECRET_ACCESS_KEY=$S3_SECRET_KEY"
      echo "export AWS_REGION=us-east-1"
    fi
  } >"$STATE/env"
}

stop_all() {
  [ -d "$STATE" ] || return 0
  for pidfile in "$STATE"/*/pid; do
    [ -f "$pidfile" ] || continue
    local pid; pid=$(cat "$pidfile")
    if kill -0 "$pid" 2>/dev/null; then kill "$pid" 2>/dev/null || true; fi
    for _ in $(seq 1 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -9 "$pid" 2>/dev/null || true
    rm -f "$pidfile"
  done
  # Cluster state files would make the next start rejoin a dead cluster.
  rm -rf "$STATE"/cluster-* "$STATE/s3/data"
}

case "${1:-}" in
  start)
    mkdir -p "$STATE"
    install_redis
    make_tls_cert
    start_redis redis "$REDIS_PORT"
    start_redis redis-tls 0 --tls-port "$REDIS_TLS_PORT" --tls-cert-file "$STATE/tls/server.crt" \
      --tls-key-file "$STATE/tls/server.key" --tls-ca-cert-file "$STATE/tls/ca.crt" --tls-auth-clients no
    wait_for_redis "$REDIS_PORT"
    wait_for_redis "$REDIS_TLS_PORT" --tls --cacert "$STATE/tls/ca.crt"
    start_cluster
    if [ "$WITH_S3" != no ] && [ -f tier-s3/Cargo.toml ]; then
      install_s3s
      start_s3
    fi
    write_env
    log "started; source $STATE/env"
    ;;
  stop) stop_all; log "stopped" ;;
  status)
    # One line per server `start` started; exit 3 (as LSB's status) when
    # one is dead or none runs.
    found=0 dead=0
    for pidfile in "$STATE"/*/pid; do
      [ -f "$pidfile" ] || continue
      found=1
      name=$(basename "$(dirname "$pidfile")")
      pid=$(cat "$pidfile")
      if kill -0 "$pid" 2>/dev/null; then
        echo "$name: running (pid $pid)"
      else
        echo "$name: dead (pid $pid gone; log in $(dirname "$pidfile")/log)"
        dead=1
      fi
    done
    if [ "$found" = 0 ]; then
      echo "services: none running (scripts/services.sh start starts them)"
      exit 3
    fi
    [ "$dead" = 0 ] || exit 3
    ;;
  *) echo "usage: $0 start|stop|status" >&2; exit 2 ;;
esac
