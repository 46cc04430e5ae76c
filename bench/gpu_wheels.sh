#!/usr/bin/env bash
# The wheels the GPU suite needs that the device machine's image lacks (or holds at another version),
# into .whl/ at the repository root, ignored by git; the device call carries it (docs/gpu-bench.md).
#
#   bash bench/gpu_wheels.sh        # here, with network; ~22 MB
#
# The image has torch 2.11 (cu130), triton, accelerate, tokenizers, safetensors, pyarrow, pandas, xxhash
# (/work/.library/device/KINDS.md). Carried: this checkout's transformers, TRL, peft and datasets (the
# versions the trainers and the CPU bench are tested with; the image's transformers 5.17 is older),
# datasets' dill and multiprocess, and the levers' liger-kernel and bitsandbytes. bitsandbytes' wheel
# (43 MB) holds a library for every CUDA and ROCm release; only CUDA 13.0's (torch cu130) and the CPU
# one are kept, so the working tree and the wheels stay well under the call's 64 MiB.
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS=(
  transformers==5.23.0 trl==1.16.0 peft==0.21.2 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19
  liger-kernel==0.8.5 bitsandbytes==0.50.2
)
exclude="$(git rev-parse --git-path info/exclude)"
mkdir -p "$(dirname "$exclude")"
grep -qxF '/.whl/' "$exclude" 2>/dev/null || echo '/.whl/' >>"$exclude"
rm -rf .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
  -d .whl "${WHEELS[@]}"
python3 - <<'EOF'
"""Rewrite bitsandbytes' wheel without the native libraries torch cu130 does not load."""
import pathlib, re, zipfile

(wheel,) = pathlib.Path(".whl").glob("bitsandbytes-*.whl")
keep = re.compile(r"libbitsandbytes_(cpu|cuda130)\.so$")
slim = wheel.with_suffix(".slim")
with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(slim, "w", zipfile.ZIP_DEFLATED) as dst:
    for info in src.infolist():
        name = info.filename
        if name.endswith(".so") and not keep.search(name):
            continue
        data = src.read(name)
        if name.endswith(".dist-info/RECORD"):
            lines = data.decode().splitlines()
            data = ("\n".join(l for l in lines if not (".so," in l and not keep.search(l.split(",")[0]))) + "\n").encode()
        dst.writestr(info, data)
slim.replace(wheel)
EOF
ls -la .whl
du -sh .whl
