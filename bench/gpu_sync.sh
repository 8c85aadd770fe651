#!/usr/bin/env bash
# The GPU tier of the sync benchmark, on one host with two GPUs (trainer on GPU 0, one replica
# at tp=1 on GPU 1): the GPU tests of `weightsync serve --device cuda --transport cuda_ipc`,
# then bench/sync.py on an 8B dense model and on a Qwen3-30B-A3B-shaped MoE.
#
#     bash bench/gpu_sync.sh [OUT_DIR]      # default: $OUT, else out/gpu_sync
#
# Wheels of packages the machine lacks may wait in .whl/ (installed to /tmp/site, no index).
# Every step has a hard time limit; a step that fails leaves its log (and the tails of the
# replicas' logs) in OUT_DIR and the next step still runs. Environment knobs: REPEATS (3),
# STEPS ("pytest dense moe"; also dense-p2p: P2P and the ceilings only, and moe-short: a
# tighter limit; dense32 and dense32-p2p: the same on a 32B dense model), BUCKET_MB (1024),
# IPC_STREAMS (1), NCCL_DEBUG (WARN).
set -u -o pipefail
cd "$(dirname "$0")/.."
out=${1:-${OUT:-out/gpu_sync}}
mkdir -p "$out"
repeats=${REPEATS:-3}
steps=${STEPS:-"pytest dense moe"}
bucket_mb=${BUCKET_MB:-1024}
ipc_streams=${IPC_STREAMS:-1}

# NVLink multicast stays off: it can take a shared host's GPUs out of service.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 MC_LOG_LEVEL=ERROR NCCL_DEBUG=${NCCL_DEBUG:-WARN}
export PYTHONPATH=src
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site:src
fi

summary="$out/summary.txt"
: >"$summary"
note() { echo "$*" | tee -a "$summary"; }

note "== $(date -u +%FT%TZ) $(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | paste -sd';')"
nvidia-smi topo -m 2>/dev/null | head -4 | tee -a "$summary"
python3 -c 'import torch, fastapi, pydantic, uvicorn, typer; print("torch", torch.__version__,
"gpus", torch.cuda.device_count(), "pydantic", pydantic.VERSION)' 2>&1 | tee -a "$summary"

# Processes a step left on the GPUs (replicas run in sessions of their own) are stopped by
# pid before the next step starts.
stop_leftovers() {
    local pids
    pids=$(nvidia-smi --query-compute-apps=pid --format=csv,noheader 2>/dev/null | sort -u)
    for pid in $pids; do kill "$pid" 2>/dev/null; done
    sleep 2
    for pid in $pids; do kill -9 "$pid" 2>/dev/null; done
}

bench() {  # bench NAME LIMIT_S PRESET [MORE bench/sync.py OPTIONS]
    local name=$1 limit=$2 preset=$3 work=/tmp/weightsync-gpu-$1
    shift 3
    rm -rf "$work"
    local start=$SECONDS
    timeout -s INT -k 15 "$limit" python3 bench/sync.py --device cuda --preset "$preset" \
        --replicas 1 --rollout-tp 1 --trainer-ranks 1 --bucket-mb "$bucket_mb" \
        --ipc-streams "$ipc_streams" \
        --repeats "$repeats" --timeout-s 300 --workdir "$work" "$@" \
        >"$out/$name.out" 2>"$out/$name.log"
    local code=$?
    note "== $name: exit $code in $((SECONDS - start)) s"
    if [ $code -ne 0 ]; then
        find "$work" -name '*.log' -exec tail -n 40 {} + >>"$out/$name.log" 2>/dev/null
        tail -n 30 "$out/$name.log" | tee -a "$summary"
    fi
    sed -n '/^$/,$p' "$out/$name.out" | grep -v '^{' | tee -a "$summary"
    grep '^{' "$out/$name.out" | tail -n 1 >>"$summary"
    stop_leftovers
}

for step in $steps; do
    case $step in
    pytest)
        start=$SECONDS
        timeout -s INT -k 20 120 python3 -m pytest -p no:cacheprovider -m gpu -q -x \
            tests/test_serve_gpu.py >"$out/pytest.log" 2>&1
        note "== pytest -m gpu tests/test_serve_gpu.py: exit $? in $((SECONDS - start)) s"
        tail -n 25 "$out/pytest.log" | tee -a "$summary"
        stop_leftovers
        ;;
    dense) bench dense 180 dense-8b ;;
    dense-p2p) bench dense 60 dense-8b --methods p2p ;;
    dense32) bench dense32 300 dense-32b ;;
    dense32-p2p) bench dense32 150 dense-32b --methods p2p ;;
    moe) bench moe 240 qwen3-30b-a3b ;;
    moe-short) bench moe 100 qwen3-30b-a3b ;;
    *) note "unknown step $step" ;;
    esac
done
