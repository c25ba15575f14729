#!/usr/bin/env bash
# Makes the virtual environment that kvtier's vLLM tests (tests/vllm) and
# vLLM benchmarks run in: vLLM 0.34.0 installed without its dependencies,
# exactly the packages its tiering modules import (tests/vllm/requirements.txt,
# every version pinned, installed with --no-deps so nothing else comes in),
# and a test-only stand-in for torch (tests/vllm/torch_standin, see its
# docstring) -- or, with --real-torch, the real torch
# (tests/vllm/requirements-torch.txt: CUDA build, about 5 GB installed).
# test.sh builds kvtier into it and runs the tests: KVTIER_PY_VLLM=1 test.sh.
#
#   bindings/python/vllm-env.sh [--real-torch] [VENV]
#
# VENV defaults to bindings/python/.venv-vllm (.venv-vllm-torch with
# --real-torch). PYTHON is the interpreter that creates it (default python3;
# vLLM 0.34.0 needs CPython >= 3.11). A rerun installs nothing when the venv
# already holds this exact set. The last line printed is the venv's path.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
real_torch=0
if [ "${1:-}" = "--real-torch" ]; then
    real_torch=1
    shift
fi
if [ "$#" -gt 1 ] || [[ "${1:-}" == -* ]]; then
    echo "usage: $0 [--real-torch] [VENV]" >&2
    exit 2
fi
default_venv="$here/.venv-vllm"
if [ "$real_torch" = 1 ]; then
    default_venv="$here/.venv-vllm-torch"
fi
venv="$(realpath -m "${1:-$default_venv}")"
python="${PYTHON:-python3}"
requirements="$here/tests/vllm/requirements.txt"
requirements_torch="$here/tests/vllm/requirements-torch.txt"
standin="$here/tests/vllm/torch_standin"
stamp="$venv/.kvtier-vllm-env"

want="$({
    echo "real_torch=$real_torch standin=$standin"
    cat "$requirements"
    if [ "$real_torch" = 1 ]; then cat "$requirements_torch"; fi
} | sha256sum | cut -d' ' -f1)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
    echo "==> $venv already holds vLLM 0.34.0 and its pinned imports"
    echo "$venv"
    exit 0
fi

if [ ! -x "$venv/bin/python" ]; then
    echo "==> creating $venv"
    "$python" -m venv "$venv"
fi
if ! "$venv/bin/python" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
    echo "vllm-env.sh: vLLM 0.34.0 needs CPython >= 3.11; $venv has $("$venv/bin/python" -V)" >&2
    echo "(set PYTHON to a 3.11+ interpreter, or pass another VENV)" >&2
    exit 1
fi
pip=("$venv/bin/python" -m pip --disable-pip-version-check)
site="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"

echo "==> installing vllm==0.34.0 and its tiering imports, without dependencies"
"${pip[@]}" install --quiet --no-deps -r "$requirements"
if [ "$real_torch" = 1 ]; then
    echo "==> installing the real torch (CUDA build, about 5 GB)"
    "${pip[@]}" install --quiet --no-deps -r "$requirements_torch"
    rm -f "$site/kvtier-torch-standin.pth"
else
    if "$venv/bin/python" -c 'import importlib.metadata as m; m.version("torch")' 2>/dev/null; then
        echo "vllm-env.sh: $venv has the real torch installed; use --real-torch or another VENV" >&2
        exit 1
    fi
    echo "==> putting the test-only torch stand-in on the path ($standin)"
    echo "$standin" >"$site/kvtier-torch-standin.pth"
fi

echo "==> importing vLLM's tiering modules"
"$venv/bin/python" - <<'EOF'
import importlib
import sys

import torch

for name in (
    "vllm.v1.kv_offload.tiering.base",
    "vllm.v1.kv_offload.tiering.factory",
    "vllm.v1.kv_offload.tiering.manager",
    "vllm.v1.kv_offload.tiering.fs.manager",
    "vllm.v1.kv_offload.cpu.manager",
    "vllm.v1.kv_offload.tiering.spec",
    "vllm.v1.kv_offload.tiering.async_lookup",
):
    importlib.import_module(name)
fs_io = sys.modules["vllm.v1.kv_offload.tiering.fs.io"]
kind = "stand-in" if hasattr(torch, "TorchStandinError") else "real"
print(f"    torch {torch.__version__} ({kind}); fs tier C I/O (vllm.fs_io_C): {fs_io._HAS_FSIO_C}")
EOF
echo "$want" >"$stamp"
echo "$venv"
