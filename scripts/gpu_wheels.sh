#!/usr/bin/env bash
# Wheels for a CUDA machine that has torch but not this stack's control-plane packages and
# cannot reach a package index (the project's GPU runs, docs/gpu.md; aiohttp and orjson for
# `bench mlc-relay`'s shims and client; pytest-asyncio for the async tests the image's pytest
# cannot run without it): downloads them for its
# Python (3.12 by default) into .gpuwhl/, NIXL's CUDA 13 build into .gpunixl/ trimmed of what
# a KV path does not load (its expert-parallel extensions, UCX's perftest, the AWS / Azure
# storage plugins' libraries: 237 MB unpacked, 59 MB packed, down to 24 MB, so both folders
# and a tree fit a 64 MiB carry), and writes .gpuwhl/prep.sh, which installs them into
# /tmp/site there: `source .gpuwhl/prep.sh; export PYTHONPATH=$PWD:/tmp/site`.
set -euo pipefail
cd "$(dirname "$0")/.."
py=${GPU_PYTHON_VERSION:-3.12}
platforms=()
for tag in manylinux_2_17 manylinux_2_24 manylinux_2_27 manylinux_2_28 manylinux_2_31 \
    manylinux_2_34 manylinux_2_5 manylinux2014 manylinux1; do
  platforms+=(--platform "${tag}_x86_64")
done
download() {  # folder, requirements...
  local dir=$1; shift
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$py" \
    --implementation cp "${platforms[@]}" -d "$dir" "$@"
}
rm -rf .gpuwhl .gpunixl
mkdir -p .gpuwhl .gpunixl
download .gpuwhl "grpcio==1.85.1" "protobuf>=7.35.1" "grpcio-health-checking==1.85.1" \
  "grpcio-reflection==1.85.1" fastapi starlette pydantic pydantic-core pydantic-settings \
  python-dotenv uvicorn opentelemetry-api importlib-metadata typing-inspection annotated-types \
  httptools py-spy \
  aiohttp aiohappyeyeballs aiosignal attrs frozenlist multidict propcache yarl idna orjson \
  pytest-asyncio
download .gpunixl "nixl-cu13==1.5.1"
python3 - .gpunixl/nixl_cu13-*.whl <<'TRIM'
import fnmatch, os, sys, zipfile
DROP = ("nixl_ep_cu13/*", "nixl_cu13.libs/ucx/libucx_perftest*", "nixl_cu13.libs/libaws*",
        "nixl_cu13.libs/libazure*")
wheel = sys.argv[1]
with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(wheel + ".tmp", "w", zipfile.ZIP_DEFLATED) as dst:
    for info in src.infolist():
        if not any(fnmatch.fnmatch(info.filename, pattern) for pattern in DROP):
            dst.writestr(info, src.read(info))
os.replace(wheel + ".tmp", wheel)
TRIM
cat > .gpuwhl/prep.sh <<'PREP'
# Installs the carried wheels into /tmp/site (scripts/gpu_wheels.sh wrote this).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .gpuwhl/*.whl .gpunixl/*.whl
export PATH=/tmp/site/bin:$PATH
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
PREP
du -sh .gpuwhl .gpunixl
