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

# The wheel is abi3 for CPython >= 3.9, and below 3.10 it takes the plain
# (non-METH_FASTCALL) call path: run the same suite on a 3.9 when the
# machine has one (pyenv's, on this project's machines).
py39=""
if python3.9 -c 'pass' 2>/dev/null; then
  py39=python3.9
else
  for candidate in "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.9*/bin/python3.9; do
    if [ -x "$candidate" ]; then py39="$candidate"; fi
  done
fi
if [ -n "$py39" ]; then
  echo "== Python package on CPython 3.9 ($py39): the abi3 floor, without fast calls"
  PYTHON="$py39" KVTIER_PY_VENV=bindings/python/.venv39 bash bindings/python/test.sh
else
  echo "== SKIPPED the CPython 3.9 run: no python3.9 on this machine"
fi

echo "== Python package with vLLM 0.34.0 (bindings/python/.venv-vllm, vllm-env.sh; tests/vllm)"
KVTIER_PY_VLLM=1 bash bindings/python/test.sh tests/vllm

echo "== examples (short runs)"
cargo run --locked --quiet -p examples --bin scheduler_sim -- --steps 200 --requests 64
# Every request waits for S3 (README, "Latency of a stack") at the default
# 1 s deadline per call; the run fails if a tier misses its deadline for
# most keys. (The workspace builds dependencies optimised in the dev
# profile, so the AWS SDK's client costs here are a release build's.)
cargo run --locked --quiet -p examples --bin scheduler_sim -- --steps 200 --requests 60 \
  --redis "$KVTIER_REDIS_URL" --redis-cluster "$KVTIER_REDIS_CLUSTER_URLS" \
  --s3 "$KVTIER_S3_BUCKET" --s3-endpoint "$KVTIER_S3_ENDPOINT" \
  --plot target/scheduler_sim/time_to_answer --json
test -s target/scheduler_sim/time_to_answer.svg && test -s target/scheduler_sim/time_to_answer.png
cargo run --locked --quiet -p examples --bin scheduler_sim -- --steps 50 --requests 16 --no-mock \
  --redis "$KVTIER_REDIS_TLS_URL" --redis-ca "$KVTIER_REDIS_TLS_CA"
cargo run --locked --quiet --example minimal
cargo run --locked --quiet --example custom_tier
cargo run --locked --quiet -p examples --bin kvbench -- all --quick

echo "== all tests passed"
