#!/usr/bin/env bash
# Every GPU check in one run, on a machine with an NVIDIA GPU and only its own image (no
# internet): planned to take about 7 minutes, with a deadline (GPU_CHECK_BUDGET_S, 450 s by
# default) after which the remaining steps are recorded as not run, so that the whole check
# and a rerun fit in 15 minutes.
#
#   bash scripts/gpu_check.sh [OUT]          # OUT defaults to results/gpu
#
# In order of importance (a step that would start after the deadline is skipped, and fails):
#   1. pytest tests/test_gpu.py tests/test_staging.py: the CUDA kernels against the float64
#      oracle and the NumPy reference bits, and the collectives staged through pinned buffers
#   2. stages 0-3 on the GPU (MLP, fp32 and fp16): at N = 2 beside the same runs on the CPU
#      (the four GPU stages give the same bits; the losses follow the CPU's within 1e-4 fp32,
#      2e-2 fp16, relative), at N = 4 the GPU stages alone
#   3. scripts/bench_adam.py on the GPU: the fused AdamW against a device-to-device copy of
#      the same bytes (goal >= 0.8x) and the NumPy-on-CuPy reference, 1M-64M elements
#   4. python -m zerompi.bench --device gpu at N = 2 (staged MPI, 1-256 MiB), and --comm nccl
#      (N = 1 on one GPU: NCCL refuses two ranks on one GPU), with --check
#   5. the default GPT on the GPU (60 steps, N = 2), and 30 steps over NCCL
#   6. scripts/bench_floor.py --device gpu: one GPT step per stage against the same GPT's
#      matrix multiplies alone on this GPU (the floor), N = 1 and 2, stages bit-identical
#   7. scripts/bench_torch_gpt.py --device gpu, where PyTorch is installed: the same GPT's
#      step under PyTorch (fp32, bf16 autocast) beside zerompi's, after a loss/gradient parity check
#   8. what landed since the first version of this script, each on the GPU: bf16 (stages 0-3
#      bit-identical, losses beside the CPU's), two-level collectives with qwZ int8 + qgZ int4
#      (N = 4 in 2 nodes, stages bit-identical), hpZ, and optimizer offload (cpu and nvme,
#      stages 2 and 3: the same bits as without offload)
#   9. Muon on the GPU: stages 0-3 bit-identical, the losses beside the CPU's
#  10. the MoE GPT (--experts 4, --ep 1: the router, experts and aux loss on CuPy) at stage 3,
#      N = 2, beside the same run on the CPU (losses within 1e-4; routing counts shown)
#  11. tensor, sequence, pipeline and expert parallelism on the GPU (--tp 2, --sp 2, --pp 2, --ep 2; a small
#      GPT, N = 4): stages 1 and 3 bit-identical, the losses beside the CPU's (stage 3)
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
BUDGET=${GPU_CHECK_BUDGET_S:-450}
run() {   # run NAME TIMEOUT_S COMMAND...: output to OUT/NAME.log, status to OUT/status.txt
    local name=$1 limit=$2
    shift 2
    if [ "$SECONDS" -ge "$BUDGET" ]; then   # past the deadline: recorded as not run (exit -1)
        echo "$name -1 0" >>"$OUT/status.txt"
        echo "== $name: not run (the ${BUDGET} s budget is spent)"
        fail=1
        return
    fi
    local t0=$SECONDS left=$((BUDGET + 90 - SECONDS))   # no step runs far past the deadline
    [ "$limit" -le "$left" ] || limit=$left
    timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    echo "$name $rc $((SECONDS - t0))" >>"$OUT/status.txt"
    echo "== $name: exit $rc in $((SECONDS - t0)) s"
    [ $rc -eq 0 ] || { fail=1; tail -n 25 "$OUT/$name.log"; }
}
MLP="--model mlp --width 256 --depth 4 --batch 32 --steps 8 --micro-batches 2 --clip 1.0 --bucket-mb 0.25"
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
        devices="gpu cpu"
        [ "$n" -eq 2 ] || devices=gpu      # the GPU against the CPU once; at N = 4 the GPU stages alone
        for device in $devices; do
            for stage in 0 1 2 3; do
                run "parity_${device}_n${n}_${dtype}_s${stage}" 120 mpiexec -n "$n" "$PY" -m zerompi.train \
                    --device "$device" $MLP --dtype "$dtype" --stage "$stage" \
                    --metrics-json "$OUT/parity_${device}_n${n}_${dtype}_s${stage}.json"
            done
        done
    done
done

run bench_adam 180 "$PY" scripts/bench_adam.py --backend gpu --sizes 1,16,64 --json "$OUT/bench_adam.json"
run bench_comm 180 mpiexec -n 2 "$PY" -m zerompi.bench --device gpu --op all -b 1M -e 256M -f 4 --dtype fp16 \
    --iters 10 --warmup 2 --check --no-overlap --json "$OUT/bench_comm.json"
# NCCL refuses two ranks on one GPU: with one GPU it runs at N = 1 (a check of the calls, not of the wire).
gpus=$("$PY" -c "import cupy; print(cupy.cuda.runtime.getDeviceCount())" 2>/dev/null || echo 1)
nccl_n=$(( gpus >= 2 ? 2 : 1 ))
run bench_nccl 120 mpiexec -n "$nccl_n" "$PY" -m zerompi.bench --device gpu --comm nccl --op all -b 1M -e 256M -f 4 \
    --dtype fp16 --iters 10 --warmup 2 --check --no-overlap --json "$OUT/bench_nccl.json"
run gpt 180 mpiexec -n 2 "$PY" -m zerompi.train --device gpu --steps 60 --eval-every 30 \
    --metrics-json "$OUT/gpt.json"
run gpt_nccl 120 mpiexec -n "$nccl_n" "$PY" -m zerompi.train --device gpu --comm nccl --steps 30 --eval-every 30 \
    --batch 48 --metrics-json "$OUT/gpt_nccl.json"

# 6-7. The GPT against its GEMM floor on this GPU, and under PyTorch (JSON lines in the logs).
run bench_floor 150 "$PY" scripts/bench_floor.py --device gpu --models gpt-default,gpt-6x256 --ranks 1,2 \
    --no-cli --rounds 1 --repeats 5
if "$PY" -c "import torch; assert torch.cuda.is_available()" >/dev/null 2>&1; then
    run bench_torch 150 "$PY" scripts/bench_torch_gpt.py --device gpu --models gpt-default,gpt-6x256 \
        --repeats 10 --json "$OUT/bench_torch.json"
else
    echo "== bench_torch: PyTorch with CUDA is not installed here: not compared" | tee "$OUT/bench_torch.log"
fi

# 8. What landed since: bf16, two levels + ZeRO++ quantization, hpZ, offload -- each on the GPU.
for device in gpu cpu; do
    for stage in 0 1 2 3; do
        run "bf16_${device}_s${stage}" 120 mpiexec -n 2 "$PY" -m zerompi.train --device "$device" $MLP \
            --dtype bf16 --stage "$stage" --metrics-json "$OUT/bf16_${device}_s${stage}.json"
    done
done
for stage in 1 2 3; do
    run "zeropp_gpu_s${stage}" 120 mpiexec -n 4 "$PY" -m zerompi.train --device gpu $MLP --dtype fp16 \
        --stage "$stage" --node-size 2 --quantize-weights int8 --quantize-grads int4 \
        --metrics-json "$OUT/zeropp_gpu_s${stage}.json"
done
run hpz_gpu_s3 120 mpiexec -n 4 "$PY" -m zerompi.train --device gpu $MLP --dtype fp16 --stage 3 --node-size 2 \
    --hpz --metrics-json "$OUT/hpz_gpu_s3.json"
run twolevel_gpu_s3 120 mpiexec -n 4 "$PY" -m zerompi.train --device gpu $MLP --dtype fp16 --stage 3 --node-size 2 \
    --metrics-json "$OUT/twolevel_gpu_s3.json"
offload_dir=$(mktemp -d "${TMPDIR:-/tmp}/zerompi-gpu-offload.XXXXXX")
for stage in 2 3; do
    for where in cpu nvme; do
        run "offload_${where}_gpu_s${stage}" 120 mpiexec -n 2 "$PY" -m zerompi.train --device gpu $MLP --dtype fp16 \
            --stage "$stage" --offload-optimizer "$where" $([ "$where" = nvme ] && echo "--offload-dir $offload_dir") \
            --metrics-json "$OUT/offload_${where}_gpu_s${stage}.json"
    done
done
rm -rf "$offload_dir"

# 9. Muon (--optimizer muon, engine/muon.py; the matrices to their owners and back through host memory):
#    stages 0-3 on the GPU bit-identical, the losses beside the CPU's.
for device in gpu cpu; do
    for stage in 0 1 2 3; do
        run "muon_${device}_s${stage}" 120 mpiexec -n 2 "$PY" -m zerompi.train --device "$device" --optimizer muon \
            --dtype fp32 --stage "$stage" --steps 20 --eval-every 0 --metrics-json "$OUT/muon_${device}_s${stage}.json"
    done
done

# 10. The MoE GPT on the GPU (moe/mlp.py on CuPy; --ep 2 is step 11's), stage 3, beside the CPU run (the C
#     kernels there).
for device in gpu cpu; do
    run "moe_${device}_s3" 120 mpiexec -n 2 "$PY" -m zerompi.train --device "$device" --experts 4 --top-k 2 \
        --dtype fp32 --stage 3 --steps 20 --eval-every 0 --metrics-json "$OUT/moe_${device}_s3.json"
done

# 11. The model-parallel modes on the GPU (their exchanges staged through host memory: comm/mesh.py,
#     comm/alltoall.py, comm/p2p.py, comm/sources_reduce.py), stages 1 and 3, beside the CPU.
SMALL="--n-layer 4 --d-model 128 --n-head 4 --seq-len 64 --batch 8 --steps 10 --eval-every 0 --dtype fp32"
for mode in tp sp pp ep; do
    case $mode in
        tp) flags="--tp 2" ;;
        sp) flags="--sp 2" ;;
        pp) flags="--pp 2 --micro-batches 2" ;;
        ep) flags="--experts 4 --top-k 2 --ep 2" ;;
    esac
    for run_on in gpu_s1 gpu_s3 cpu_s3; do      # the CPU once: its stages' bits are the CPU suite's
        run "${mode}_${run_on}" 120 mpiexec -n 4 "$PY" -m zerompi.train --device "${run_on%_s*}" $SMALL $flags \
            --stage "${run_on#*_s}" --metrics-json "$OUT/${mode}_${run_on}.json"
    done
done

"$PY" scripts/gpu_summary.py "$OUT" || fail=1
exit $fail
