#!/usr/bin/env bash
# The engine-check environment: vLLM 0.23.0 + vLLM-Ascend 0.23.0.post1 on CPU, isolated from dsconv's .venv.
#   bash dsconv/engine_check/setup_env.sh [--print-python]
# Cached under ${DSCONV_ENGINE_CACHE:-~/.cache/dsconv}/engine-<hash of this file and requirements.txt>, so a clean
# clone on the same machine reuses it; ~3.3 GB, a few minutes the first time (PyPI only).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
VLLM_VERSION=0.23.0
VLLM_ASCEND_VERSION=0.23.0.post1
key=$(cat "$here/setup_env.sh" "$here/requirements.txt" | sha256sum | cut -c1-12)
root="${DSCONV_ENGINE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/dsconv}/engine-$key"
py="$root/venv/bin/python"
if [ -f "$root/.ready" ]; then
  [ "${1:-}" = "--print-python" ] && echo "$py"
  exit 0
fi
say() { echo "engine-check setup: $*" >&2; }
rm -rf "$root" && mkdir -p "$root"
t0=$(date +%s)
say "creating $root/venv"
python3 -m venv "$root/venv"
pip() { "$root/venv/bin/pip" --disable-pip-version-check -q "$@"; }
pip install pip==26.3
say "installing the frozen requirements (torch CPU wheel, transformers $(grep '^transformers==' "$here/requirements.txt" | cut -d= -f3), vLLM's runtime deps)"
pip install -r "$here/requirements.txt" 2> >(grep -v "^WARNING: Location" >&2)
say "installing vllm==$VLLM_VERSION from its source distribution (pure Python: VLLM_TARGET_DEVICE=empty)"
VLLM_TARGET_DEVICE=empty VLLM_VERSION_OVERRIDE=$VLLM_VERSION \
  pip install --no-deps --no-build-isolation --no-binary=vllm "vllm==$VLLM_VERSION"
say "unpacking vllm-ascend==$VLLM_ASCEND_VERSION (not built: its kernels need CANN)"
mkdir -p "$root/dl"
SOC_VERSION=ascend910b1 pip download --no-deps --no-build-isolation --no-binary=:all: \
  "vllm-ascend==$VLLM_ASCEND_VERSION" -d "$root/dl"
tar -xzf "$root/dl/vllm_ascend-$VLLM_ASCEND_VERSION.tar.gz" -C "$root"
src="$root/vllm_ascend-$VLLM_ASCEND_VERSION"
# what its setup.py would generate for an Atlas A2 (910B) build
printf "# written by dsconv's engine-check setup, as vllm-ascend's setup.py does for SOC_VERSION=ascend910b1\n__device_type__ = 'A2'\n" \
  > "$src/vllm_ascend/_build_info.py"
site=$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
# the source tree (with its egg-info: the `ascend` platform plugin entry point) on sys.path
echo "$src" > "$site/vllm_ascend_src.pth"
# NPU stand-ins in every process of this venv when DSCONV_NPU_STUBS is set (vLLM inspects models in a subprocess)
echo 'import os; exec("if os.environ.get(\"DSCONV_NPU_STUBS\"):\n import npu_stubs; npu_stubs.install()")' \
  > "$site/dsconv_npu_stubs.pth"
DSCONV_NPU_STUBS=1 PYTHONPATH="$here" "$py" -c 'import vllm, vllm_ascend; print("vllm", vllm.__version__)' >&2
touch "$root/.ready"
say "ready in $(( $(date +%s) - t0 )) s, $(du -sh "$root" | cut -f1)"
[ "${1:-}" = "--print-python" ] && echo "$py"
exit 0
