#!/usr/bin/env bash
# Builds the kvtier Python package into a virtual environment of its own
# and runs its pytest suite against the test services named by KVTIER_* /
# AWS_* in the environment (scripts/test.sh sources them; in a dev shell,
# `source .services/env` first).
#
#   bindings/python/test.sh [pytest arguments...]
#
# Environment:
#   KVTIER_PY_VENV     the virtual environment (default bindings/python/.venv)
#   KVTIER_PY_RELEASE  1 builds an optimised extension (benchmarks); the
#                      default is the debug profile, which shares the
#                      workspace's debug build and compiles in seconds.
#   PYTHON             the interpreter that creates the venv (default python3)
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
venv="$(realpath -m "${KVTIER_PY_VENV:-$here/.venv}")"
python="${PYTHON:-python3}"

# Pinned tools, from the package index.
MATURIN_VERSION=1.9.6
PYTEST_VERSION=9.2.0
REDIS_PY_VERSION=8.1.0

if [ ! -x "$venv/bin/python" ]; then
    echo "==> creating $venv"
    "$python" -m venv "$venv"
fi
# CPython 3.9 (the abi3 floor) needs the last releases that support it.
if ! "$venv/bin/python" -c 'import sys; sys.exit(sys.version_info < (3, 10))'; then
    PYTEST_VERSION=8.4.2
    REDIS_PY_VERSION=7.0.1
fi
echo "==> installing maturin==$MATURIN_VERSION pytest==$PYTEST_VERSION redis==$REDIS_PY_VERSION"
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check \
    "maturin==$MATURIN_VERSION" "pytest==$PYTEST_VERSION" "redis==$REDIS_PY_VERSION"

profile_args=()
if [ "${KVTIER_PY_RELEASE:-0}" = "1" ]; then
    profile_args=(--release)
fi
echo "==> building the extension (maturin develop ${profile_args[*]:-})"
(
    cd "$here"
    VIRTUAL_ENV="$venv" PATH="$venv/bin:$PATH" \
        "$venv/bin/maturin" develop --locked "${profile_args[@]}"
)
"$venv/bin/python" -c "import kvtier; print('==> kvtier imported from', kvtier.__file__)"

# Never ask the EC2 metadata service for credentials.
export AWS_EC2_METADATA_DISABLED=true

set +e
(cd "$here" && "$venv/bin/python" -m pytest -q -p no:cacheprovider "$@")
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
    echo "bindings/python/test.sh: pytest collected no tests" >&2
    exit 1
fi
exit "$rc"
