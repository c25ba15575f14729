#!/usr/bin/env bash
# Every test of the workspace, from a fresh clone: the README's test command.
#
#   scripts/test.sh            # all tests, then every example in a short run
#
# CI (.ci/run) runs exactly this after fmt and clippy.
set -euo pipefail
cd "$(dirname "$0")/.."

export RUST_BACKTRACE=1
# Property tests: a fixed budget so CI time stays predictable.
export PROPTEST_CASES="${PROPTEST_CASES:-1024}"

echo "== cargo test (unit, integration, doc)"
cargo test --workspace --locked --all-features

echo "== examples (short runs)"
cargo run --locked --quiet -p examples --bin scheduler_sim -- --steps 200 --requests 64
cargo run --locked --quiet -p examples --bin minimal
cargo run --locked --quiet -p examples --bin kvbench -- all --quick --json >/dev/null

echo "== all tests passed"
