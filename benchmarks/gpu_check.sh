#!/usr/bin/env bash
# The checks to run where a GPU is lent (CI has none): the CUDA parity tests, `flatshard
# bench` on one GPU (small and larger GPT) and a short bf16 `flatshard train`.
# Run from the repository root: bash benchmarks/gpu_check.sh; logs land in ${OUT:-runs/gpu}.
set -u
out=${OUT:-runs/gpu}
mkdir -p "$out"
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
py=${PYTHON:-python3}
scratch=$(mktemp -d)
nvidia-smi -L
$py -c 'import torch; print("torch", torch.__version__, torch.cuda.get_device_name())'

timeout 240 $py -m pytest -q -s -p no:cacheprovider tests/test_gpu.py 2>&1 | tee "$out/tests.log"

bench() {  # name, then bench options
    local name=$1
    shift
    timeout 200 $py -m flatshard.cli.main bench --nproc 1 --device cuda \
        --out "$scratch/$name" "$@" 2>&1 | tee "$out/$name.log"
    cp "$scratch/$name/bench.json" "$out/$name.json"
}
bench bench_small --rounds 2 --steps 10
bench bench_big --dim 1024 --layers 16 --heads 16 --seq-len 1024 --batch 8 --rounds 1 --steps 5

timeout 120 $py -m flatshard.cli.main train --nproc 1 --steps 40 --mixed-precision bf16 \
    --log-every 10 --sample-bytes 80 --out-dir "$scratch/train" 2>&1 | tee "$out/train.log"
