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
# No test may reach the AWS instance-metadata address: credentials come from
# the environment or the test's own configuration.
export AWS_EC2_METADATA_DISABLED=true

# scheduler_sim --plot draws its text with a system TrueType font.
if [ -z "${KVTIER_PLOT_FONT:-}" ] && [ ! -f /usr/share/fonts/truetype/dejavu/DejaVuSans.ttf ]; then
  echo "== installing fonts-dejavu-core (the plot's font) with apt"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq && apt-get install -y -qq fonts-dejavu-core >/dev/null
fi

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

echo "== Python package (bindings/python: its own venv, maturin, pytest)"
bash bindings/python/test.sh

echo "== examples (short runs)"
cargo run --locked --quiet -p examples --bin scheduler_sim -- --steps 200 --requests 64
cargo run --locked --quiet -p examples --bin scheduler_sim -- --steps 200 --requests 60 \
  --redis "$KVTIER_REDIS_URL" --redis-cluster "$KVTIER_REDIS_CLUSTER_URLS" \
  --s3 "$KVTIER_S3_BUCKET" --s3-endpoint "$KVTIER_S3_ENDPOINT" --plot target/scheduler_sim/time_to_answer --json
test -s target/scheduler_sim/time_to_answer.svg && test -s target/scheduler_sim/time_to_answer.png
cargo run --locked --quiet -p examples --bin scheduler_sim -- --steps 50 --requests 16 --no-mock \
  --redis "$KVTIER_REDIS_TLS_URL" --redis-ca "$KVTIER_REDIS_TLS_CA"
cargo run --locked --quiet --example minimal
cargo run --locked --quiet --example custom_tier
cargo run --locked --quiet -p examples --bin kvbench -- all --quick

echo "== all tests passed"
