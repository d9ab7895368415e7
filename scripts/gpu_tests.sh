#!/usr/bin/env bash
# The test suite on a GPU machine, in groups that each fit one device call (10 minutes), with
# the Triton kernels compiled (not interpreted). Logs go to OUTDIR/pytest_<group>*.txt.
#
# Usage, from the repo root on the GPU machine:  bash scripts/gpu_tests.sh GROUP OUTDIR
#   correctness  tests/test_correctness.py, as two processes at once (FLCE cases / the rest)
#   kernels      the Triton kernel files, PDL, sm90 compile checks, the CUDA-graph step, the
#                launch cache
#   integration  the four transformers integration files
#   rest         every other file (dispatch, CLI, harness, distributed on the CPU, ...)
# Session 15 ran test_correctness this way in about 255 s on one H200; the other groups, as
# grouped here, are not timed yet.
set -uo pipefail
group=${1:?GROUP: correctness, kernels, integration or rest}
out=${2:?OUTDIR}
mkdir -p "$out"
source scripts/gpu_env.sh >"$out/env.txt" 2>&1
export TRITON_INTERPRET=0

kernels=(tests/test_triton_norms.py tests/test_triton_flce.py tests/test_triton_rope_glu.py
    tests/test_triton_glu_inplace.py tests/test_compile_sm90.py tests/test_pdl.py
    tests/test_cuda_graph_step.py tests/test_launch.py)
integration=(tests/test_integration_transformers.py tests/test_integration_families.py
    tests/test_integration_compile.py tests/test_integration_ecosystem.py)

run() {  # run NAME PYTEST-ARGS...: one pytest process, its log and exit status
    local name=$1
    shift
    python3 -m pytest -q -p no:cacheprovider "$@" >"$out/pytest_$name.txt" 2>&1
    local rc=$?
    echo "$name: exit $rc, $(tail -n 1 "$out/pytest_$name.txt")"
    return $rc
}

case $group in
correctness)
    run correctness_flce tests/test_correctness.py -k fused_linear_cross_entropy &
    flce=$!
    run correctness_rest tests/test_correctness.py -k "not fused_linear_cross_entropy"
    rest=$?
    wait $flce && exit $rest
    ;;
kernels) run kernels "${kernels[@]}" ;;
integration) run integration "${integration[@]}" ;;
rest)
    ignore=()
    for f in tests/test_correctness.py "${kernels[@]}" "${integration[@]}"; do
        ignore+=(--ignore "$f")
    done
    run rest tests "${ignore[@]}"
    ;;
*)
    echo "unknown group $group: correctness, kernels, integration or rest" >&2
    exit 2
    ;;
esac
