#!/usr/bin/env bash
# Fetches vLLM 0.34.0's own tests of its offloading code
# (tests/v1/kv_offload/ of the source distribution on the package index)
# into DEST (default bindings/python/.vllm-tests), for
# tests/vllm/test_vllm_async_lookup.py. Nothing of it enters the repository.
#
#   bindings/python/tests/vllm/fetch-vllm-tests.sh [DEST]
#
# Why this way: `pip download --no-binary :all: vllm==0.34.0` must prepare
# the sdist's metadata, which runs vLLM's setup.py: it imports torch and
# needs setuptools-rust and setuptools-scm. A throwaway venv gets those
# (pinned) and the test-only torch stand-in; with VLLM_TARGET_DEVICE=empty
# setup.py then needs no CUDA, but names the version 0.34.0+empty, which pip
# refuses after unpacking ("inconsistent version"). --no-clean keeps the
# unpacked source, from which tests/v1/kv_offload is copied. About 50 MB
# downloaded, under a minute. A rerun with DEST present does nothing.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
dest="$(realpath -m "${1:-$here/../../.vllm-tests}")"
if [ -f "$dest/tests/v1/kv_offload/tiering/test_async_lookup.py" ]; then
    echo "$dest"
    exit 0
fi
python="${PYTHON:-python3}"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
"$python" -m venv "$work/venv"
pip=("$work/venv/bin/python" -m pip --disable-pip-version-check)
"${pip[@]}" install --quiet setuptools==80.9.0 setuptools-rust==1.13.0 setuptools-scm==10.3.4 \
    wheel==0.48.0 packaging==26.4 Jinja2==3.1.6 MarkupSafe==3.0.4 numpy==2.4.6
site="$("$work/venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
echo "$here/torch_standin" >"$site/kvtier-torch-standin.pth"
mkdir -p "$work/tmp"
VLLM_TARGET_DEVICE=empty TMPDIR="$work/tmp" "${pip[@]}" download --quiet vllm==0.34.0 \
    --no-binary :all: --no-deps --no-build-isolation --no-clean -d "$work/dl" >/dev/null 2>&1 || true
src="$(find "$work/tmp" -maxdepth 5 -type d -path '*/tests/v1' -print -quit)"
if [ -z "$src" ] || [ ! -f "$src/kv_offload/tiering/test_async_lookup.py" ]; then
    echo "fetch-vllm-tests.sh: the vLLM 0.34.0 sdist was not unpacked (see pip download above)" >&2
    exit 1
fi
mkdir -p "$dest/tests/v1"
cp -a "$src/kv_offload" "$dest/tests/v1/"
cp "$(dirname "$(dirname "$src")")/PKG-INFO" "$dest/PKG-INFO"
echo "$dest"
