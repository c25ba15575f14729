#!/usr/bin/env bash
# Every test of the workspace, from a fresh clone: the README's test command.
#
#   scripts/test.sh            # start the services, all tests, every example in a short run
#   KVTIER_KEEP_SERVICES=1 scripts/test.sh   # leave the services running afterwards
#
# CI (.ci/run) runs exactly this after fmt and clippy.
set -euo pipefail
cd "$(dirname "$0")/.."

export RUST_BACKTRACE=1

echo "== services (redis-server single node, TLS node, 3-master cluster; s3s-fs)"
bash scripts/services.sh start
if [ "${KVTIER_KEEP_SERVICES:-0}" != 1 ]; then
  trap 'bash scripts/services.sh stop' EXIT
fi
# shellcheck disable=SC1091
source .services/env
# The script above started every service: a missing one is now a failure.
export KVTIER_REQUIRE_SERVICES=1
# Property tests: a fixed budget so CI time stays predictable.
export PROPTEST_CASES="${PROPTEST_CASES:-1024}"

echo "== cargo test (unit, integration, doc)"
cargo test --workspace --locked --all-features

echo "== examples (short runs)"
cargo run --locked --quiet -p examples --bin scheduler_sim -- --steps 200 --requests 64
cargo run --locked --quiet -p examples --bin scheduler_sim -- --steps 200 --requests 60 \
  --redis "$KVTIER_REDIS_URL" --redis-cluster "$KVTIER_REDIS_CLUSTER_URLS" \
  --s3 "$KVTIER_S3_BUCKET" --s3-endpoint "$KVTIER_S3_ENDPOINT" --plot target/scheduler_sim_ttv.svg --json
cargo run --locked --quiet --example minimal
cargo run --locked --quiet --example custom_tier
cargo run --locked --quiet -p examples --bin kvbench -- all --quick

echo "== all tests passed"
