#!/usr/bin/env bash
# The kit bench/gpu_check.py installs on a lent GPU machine (no network there; a device call
# carries at most 64 MiB with the work tree): ../shared/tools/flashinfer_kit.sh's kit
# (flashinfer-python 0.7.2.post1 without the kernel sources attention never compiles,
# apache-tvm-ffi, einops; about 34 MiB) plus msgspec, the one engine dependency the device
# image lacks, all for CPython 3.12. Run here, from the repo root, where pip reaches the
# registry; `.fikit/` is git-ignored. Then, with the device tool: carry [".fikit"], command
#     PYTHONUNBUFFERED=1 python3 bench/gpu_check.py --kit .fikit
set -euo pipefail
out=${1:-.fikit}
kit_script=${FLASHINFER_KIT:-../shared/tools/flashinfer_kit.sh}
rm -rf "$out"
bash "$kit_script" "$out"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d "$out" "msgspec==0.23.0"
ls -la "$out"
du -sh "$out"
