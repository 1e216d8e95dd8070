#!/usr/bin/env bash
# The checks to run where a GPU is lent (CI has none), about 8 minutes on one GPU:
#   (0) smoke   NCCL at 2 ranks on the one GPU (each rank its own "host", sockets over
#               loopback): all-gather, reduce-scatter, all-reduce, object collectives;
#               if NCCL refuses, the later stages run on gloo with CUDA tensors
#   (1) parity  2 ranks: the parity cases as they are and under GPU lag (bitwise equal),
#               against the unsharded reference
#   (2) four    4 ranks: hybrid F = 2 (ZeRO-3 and ZeRO-2 with a kept unit), per-block
#               hybrid (communicators counted), dp 2 x tp 2, experts EP 2 x data 2, a
#               checkpoint round trip
#   (3) audit   host syncs per steady step at 2 ranks, per option
#   (4) the one-rank bench, a short bf16 train, and train at 2 ranks with --share-gpus
# Run from the repository root: bash benchmarks/gpu_check.sh. Results land in
# ${OUT:-runs/gpu} as they come (one file per stage); the exit code is non-zero if any
# stage failed. `python benchmarks/gpu_check.py STAGE --device cpu` rehearses a stage on
# gloo.
set -euo pipefail
out=${OUT:-runs/gpu}
mkdir -p "$out"
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
py=${PYTHON:-python3}

if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
    echo "gpu_check: no NVIDIA GPU here (nvidia-smi finds none); run it where one is lent" >&2
    exit 2
fi
if ! $py -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    echo "gpu_check: torch sees no CUDA device (a CPU build of torch?)" >&2
    exit 2
fi
nvidia-smi -L | tee "$out/gpu.txt"
$py -c 'import torch; print("torch", torch.__version__, torch.cuda.get_device_name())' \
    | tee -a "$out/gpu.txt"

failed=()
stage() {  # name, seconds, command...: run under its own timeout, log as it goes
    local name=$1 seconds=$2
    shift 2
    echo "=== $name ($(date +%T), at most ${seconds}s)"
    if ! timeout "$seconds" "$@" 2>&1 | tee "$out/$name.log"; then
        failed+=("$name")
        echo "=== $name FAILED"
    fi
}

backend=nccl
stage smoke 90 $py benchmarks/gpu_check.py smoke --out "$out"
if [[ " ${failed[*]-} " == *" smoke "* ]]; then
    backend=gloo  # NCCL refused: the rest on gloo, which takes CUDA tensors
    echo "gpu_check: NCCL refused two ranks on one GPU; the later stages run on gloo"
fi
stage parity 180 $py benchmarks/gpu_check.py parity --backend $backend --out "$out"
stage four 150 $py benchmarks/gpu_check.py four --backend $backend --out "$out"
stage audit 60 $py benchmarks/gpu_check.py audit --backend $backend --out "$out"

scratch=$(mktemp -d)
stage bench 60 $py -m flatshard.cli.main bench --nproc 1 --device cuda --rounds 1 \
    --steps 5 --out "$scratch/bench"
stage train_bf16 45 $py -m flatshard.cli.main train --nproc 1 --steps 30 \
    --mixed-precision bf16 --log-every 10 --sample-bytes 40 --out-dir "$scratch/train"
stage train_shared 60 $py -m flatshard.cli.main train --nproc 2 --share-gpus --steps 10 \
    --log-every 5 --sample-bytes 0 --out-dir "$scratch/shared"

if ((${#failed[@]})); then
    echo "gpu_check: failed stages: ${failed[*]}" | tee "$out/summary.txt"
    exit 1
fi
echo "gpu_check: every stage passed" | tee "$out/summary.txt"
