# The GPU machine's environment for this checkout. Two uses, from the repo root:
#
#   bash benchmarks/gpu_env.sh fetch    # here, with internet: the peers' wheels into .whl/
#   source benchmarks/gpu_env.sh        # there (no internet): src/, benchmarks/, .whl/ on the path
#
# fetch downloads liger-kernel and cut-cross-entropy (pure-Python wheels that need only torch
# and triton) and datasets (the convergence runs load the shipped text through it) for the GPU
# machine's Python 3.12 on x86-64; every data row records the versions it ran with. Sourced, the
# script puts src/ and benchmarks/ first on PYTHONPATH (lmkernels and lmkernels-bench become shell
# functions running their modules), installs the carried wheels into /tmp/site, unsets
# TRITON_INTERPRET (the kernels compile) and prints the device and versions.
if [ "${1:-}" = fetch ]; then
    set -eu
    mkdir -p .whl
    for pkg in "liger-kernel==0.8.5" "cut-cross-entropy==25.1.1" "datasets==5.2.0" "dill==0.4.1" \
        "multiprocess==0.70.19"; do
        python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
            --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
            --platform manylinux2014_x86_64 --platform any -d .whl "$pkg"
    done
    du -ch .whl/*.whl | tail -1
else
    export PYTHONUNBUFFERED=1
    export PYTHONPATH="$PWD/src:$PWD/benchmarks${PYTHONPATH:+:$PYTHONPATH}"
    lmkernels() { python3 -m lmkernels "$@"; }
    lmkernels-bench() { python3 -m lmkernels_bench "$@"; }
    if ls .whl/*.whl >/dev/null 2>&1; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target /tmp/site .whl/*.whl && export PYTHONPATH="$PYTHONPATH:/tmp/site"
    fi
    unset TRITON_INTERPRET
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    python3 -c "import torch, triton, transformers; print('torch', torch.__version__, '| triton', \
triton.__version__, '| transformers', transformers.__version__, '|', torch.cuda.get_device_name())"
fi
