#!/usr/bin/env bash
# Every GPU check in one run, on a machine with an NVIDIA GPU and only its own image (no
# internet): about 5 minutes, under 8.
#
#   bash scripts/gpu_check.sh [OUT]          # OUT defaults to results/gpu
#
#   1. pytest tests/test_gpu.py: the CUDA kernels against the float64 oracle and the NumPy
#      reference bits, and the collectives staged through pinned host buffers
#   2. stage 0-3 on the GPU at N = 2 and 4 ranks sharing it (MLP, fp32 and fp16): the four
#      stages give the same final parameters, and the losses follow a CPU run within 1e-4
#      (fp32) and 2e-2 (fp16), relative
#   3. scripts/bench_adam.py on the GPU (fused AdamW against the NumPy-on-CuPy reference
#      and a device copy)
#   4. python -m zerompi.bench --device gpu at N = 2 (staged MPI), and --comm nccl (N = 1 on
#      one GPU: NCCL refuses two ranks on one GPU), with --check
#   5. a short GPT run on the GPU (the default model, 60 steps, N = 2), and 30 steps over NCCL
# Results: OUT/*.json and OUT/*.log; scripts/gpu_summary.py prints the table last and
# writes OUT/summary.json. Exit status 0 only when every check passed.
#
# MPI: the image's mpi4py when it loads an MPI library and mpiexec is on PATH; otherwise
# the MPICH and mpi4py wheels carried in wheels/ (git-ignored; docs/gpu-results.md says
# how to fetch them), unpacked under $TMPDIR without pip's network or build steps.
set -u -o pipefail
cd "$(dirname "$0")/.."
OUT=${1:-results/gpu}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

if ! "$PY" -c "from mpi4py import MPI" >/dev/null 2>&1 || ! command -v mpiexec >/dev/null 2>&1; then
    shopt -s nullglob
    mpich=(wheels/mpich-*.whl) mpi4py=(wheels/mpi4py-*.whl)
    if [ ${#mpich[@]} -ne 1 ] || [ ${#mpi4py[@]} -ne 1 ]; then
        echo "gpu_check: no working MPI here and not exactly one mpich and one mpi4py wheel in wheels/" >&2
        exit 2
    fi
    stage_dir=${TMPDIR:-/tmp}/zerompi-gpu-mpi
    rm -rf "$stage_dir" && mkdir -p "$stage_dir/site"
    unzip -q "${mpich[0]}" '*.data/data/*' -d "$stage_dir/mpich" || exit 2
    prefix=$(echo "$stage_dir"/mpich/*.data/data)
    unzip -q "${mpi4py[0]}" -d "$stage_dir/site" || exit 2
    export PATH="$prefix/bin:$PATH" LD_LIBRARY_PATH="$prefix/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    export PYTHONPATH="$PWD:$stage_dir/site${PYTHONPATH#$PWD}"
    "$PY" -c "from mpi4py import MPI" || { echo "gpu_check: the carried mpi4py does not load" >&2; exit 2; }
fi

fail=0
run() {   # run NAME TIMEOUT_S COMMAND...: output to OUT/NAME.log, status to OUT/status.txt
    local name=$1 limit=$2
    shift 2
    local t0=$SECONDS
    timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    echo "$name $rc $((SECONDS - t0))" >>"$OUT/status.txt"
    echo "== $name: exit $rc in $((SECONDS - t0)) s"
    [ $rc -eq 0 ] || { fail=1; tail -n 25 "$OUT/$name.log"; }
}
rm -f "$OUT/status.txt"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader >"$OUT/gpu.txt" 2>&1
"$PY" - >"$OUT/env.json" <<'EOF'
import json, platform
import cupy, numpy
from mpi4py import MPI
from zerompi.comm import device
props = cupy.cuda.runtime.getDeviceProperties(0)
aware, how = device.mpi_cuda_aware()
print(json.dumps({"gpu": props["name"].decode(), "gpus": cupy.cuda.runtime.getDeviceCount(),
                  "cupy": cupy.__version__, "numpy": numpy.__version__, "python": platform.python_version(),
                  "mpi": MPI.Get_library_version().splitlines()[0], "cuda_aware": aware, "cuda_aware_how": how}))
EOF

run pytest_gpu 300 "$PY" -m pytest -q -p no:cacheprovider tests/test_gpu.py tests/test_staging.py \
    --junitxml="$OUT/pytest_gpu.xml"

for n in 2 4; do
    for dtype in fp32 fp16; do
        for device in gpu cpu; do
            for stage in 0 1 2 3; do
                run "parity_${device}_n${n}_${dtype}_s${stage}" 120 mpiexec -n "$n" "$PY" -m zerompi.train \
                    --device "$device" --model mlp --width 256 --depth 4 --batch 32 --steps 8 --micro-batches 2 \
                    --clip 1.0 --bucket-mb 0.25 --dtype "$dtype" --stage "$stage" \
                    --metrics-json "$OUT/parity_${device}_n${n}_${dtype}_s${stage}.json"
            done
        done
    done
done

run bench_adam 180 "$PY" scripts/bench_adam.py --backend gpu --sizes 1,16,64 --json "$OUT/bench_adam.json"
run bench_comm 180 mpiexec -n 2 "$PY" -m zerompi.bench --device gpu --op all -b 1M -e 64M -f 4 --dtype fp16 \
    --iters 10 --warmup 2 --check --no-overlap --json "$OUT/bench_comm.json"
# NCCL refuses two ranks on one GPU: with one GPU it runs at N = 1 (a check of the calls, not of the wire).
gpus=$("$PY" -c "import cupy; print(cupy.cuda.runtime.getDeviceCount())" 2>/dev/null || echo 1)
nccl_n=$(( gpus >= 2 ? 2 : 1 ))
run bench_nccl 120 mpiexec -n "$nccl_n" "$PY" -m zerompi.bench --device gpu --comm nccl --op all -b 1M -e 16M -f 4 \
    --dtype fp16 --iters 10 --warmup 2 --check --no-overlap --json "$OUT/bench_nccl.json"
run gpt 180 mpiexec -n 2 "$PY" -m zerompi.train --device gpu --steps 60 --eval-every 30 \
    --metrics-json "$OUT/gpt.json"
run gpt_nccl 120 mpiexec -n "$nccl_n" "$PY" -m zerompi.train --device gpu --comm nccl --steps 30 --eval-every 30 \
    --batch 48 --metrics-json "$OUT/gpt_nccl.json"

"$PY" scripts/gpu_summary.py "$OUT" || fail=1
exit $fail
