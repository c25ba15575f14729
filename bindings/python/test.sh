#!/usr/bin/env bash
# Builds the kvtier Python package into a virtual environment of its own
# and runs its pytest suite against the test services named by KVTIER_* /
# AWS_* in the environment (scripts/test.sh sources them; in a dev shell,
# `source .services/env` first).
#
#   bindings/python/test.sh [pytest arguments...]
#
# Environment:
#   KVTIER_PY_VENV     the virtual environment (default bindings/python/.venv,
#                      or .venv-vllm / .venv-vllm-torch with KVTIER_PY_VLLM)
#   KVTIER_PY_VLLM     1: the venv also holds vLLM 0.34.0 (vllm-env.sh, with
#                      the test-only torch stand-in) and tests/vllm must run:
#                      they fail instead of skipping without vLLM.
#                      torch: the same with the real torch (about 5 GB).
#                      Unset, tests/vllm skip: `import kvtier` needs no vLLM.
#   KVTIER_PY_RELEASE  1 builds an optimised extension (benchmarks; the
#                      `release` profile, symbols kept); the default is the
#                      debug profile, which shares the workspace's debug
#                      build and compiles in seconds.
#   PYTHON             the interpreter that creates the venv (default python3)
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
python="${PYTHON:-python3}"
vllm_env_args=()
case "${KVTIER_PY_VLLM:-0}" in
    0) default_venv="$here/.venv" ;;
    1) default_venv="$here/.venv-vllm" ;;
    torch) default_venv="$here/.venv-vllm-torch"; vllm_env_args=(--real-torch) ;;
    *) echo "test.sh: KVTIER_PY_VLLM is 1, torch or unset, not '$KVTIER_PY_VLLM'" >&2; exit 2 ;;
esac
venv="$(realpath -m "${KVTIER_PY_VENV:-$default_venv}")"

# Pinned tools, from the package index.
MATURIN_VERSION=1.9.6
PYTEST_VERSION=9.2.0
REDIS_PY_VERSION=8.1.0
MYPY_VERSION=2.4.1

if [ ! -x "$venv/bin/python" ]; then
    echo "==> creating $venv"
    "$python" -m venv "$venv"
fi
# CPython 3.9 (the abi3 floor) needs the last releases that support it.
if ! "$venv/bin/python" -c 'import sys; sys.exit(sys.version_info < (3, 10))'; then
    PYTEST_VERSION=8.4.2
    REDIS_PY_VERSION=7.0.1
    MYPY_VERSION=  # mypy 2 needs 3.10: the stub test skips, saying so
fi
echo "==> installing maturin==$MATURIN_VERSION pytest==$PYTEST_VERSION redis==$REDIS_PY_VERSION mypy==${MYPY_VERSION:-none}"
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check \
    "maturin==$MATURIN_VERSION" "pytest==$PYTEST_VERSION" "redis==$REDIS_PY_VERSION" \
    ${MYPY_VERSION:+"mypy==$MYPY_VERSION"}

if [ "${KVTIER_PY_VLLM:-0}" != 0 ]; then
    PYTHON="$python" bash "$here/vllm-env.sh" "${vllm_env_args[@]}" "$venv"
    export KVTIER_REQUIRE_VLLM=1
fi

# Developer builds: `dev`, or `release` (optimised, with line tables and
# symbols for profilers); a wheel uses the stripped `wheel` profile
# (pyproject.toml).
profile_args=(--profile dev)
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
