#!/usr/bin/env bash
# Download into .whl/ the wheels the benchmarks need on the GPU machine, which has no internet
# (python 3.12, manylinux x86_64; torch, triton, transformers, numpy, matplotlib, rich, tqdm,
# pytest, pytest-benchmark and tokenizers already there). scripts/gpu_env.sh installs them.
#
# liger-kernel and cut-cross-entropy are pure-python wheels whose only requirements are torch and
# triton (already on the GPU machine), so --no-deps is complete: nothing else is needed.
# Usage (from the repo root): bash scripts/fetch_gpu_wheels.sh
set -euo pipefail
cd "$(dirname "$0")/.."

# Both are the latest releases (checked 2026-11-23); every result records the versions it ran with.
PACKAGES=("liger-kernel==0.8.5" "cut-cross-entropy==25.1.1")
# The convergence harness and scripts/families_gpu.py load the shipped text through `datasets`,
# which the GPU image lacks; its other requirements (pyarrow, pandas, fsspec, xxhash, ...) are there.
PACKAGES+=("datasets==5.2.0" "dill==0.4.1" "multiprocess==0.70.19")

mkdir -p .whl
for pkg in "${PACKAGES[@]}"; do
    # --platform/--python-version describe the GPU machine, not this one; binary wheels only.
    python3 -m pip download --quiet --no-deps --only-binary=:all: \
        --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 --platform any \
        -d .whl "$pkg"
done

# Show what the GPU machine would still be missing: each wheel's requirements without extras.
python3 - <<'EOF'
import glob
import zipfile

for path in sorted(glob.glob(".whl/*.whl")):
    if not any(name in path for name in ("liger_kernel", "cut_cross_entropy")):
        continue
    with zipfile.ZipFile(path) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        requires = [
            line.split(":", 1)[1].strip()
            for line in z.read(meta).decode().splitlines()
            if line.startswith("Requires-Dist:") and "extra ==" not in line
        ]
    print(f"{path.split('/')[-1]}: requires {', '.join(requires) or 'nothing'}")
EOF
du -ch .whl/*.whl | tail -1 | sed 's/total/total size of .whl\//'
