#!/usr/bin/env bash
# The checks that need a GPU, as one time-boxed run (the device tool lends a machine for
# minutes): the zoo on CUDA with Inductor's Triton kernels, against eager on the same GPU,
#   - world size 1 (mesh tp=1, NCCL): every architecture through the whole pipeline;
#   - with 4 GPUs or more, dp=2 x tp=2 (FSDP + Megatron plans, prefetch on as it is by
#     default for GPU graphs), and the 4-layer demo Llama on it (parity, prefetched layers).
#     NCCL needs a GPU per rank; ranks sharing one over gloo crashed (zoo.cell.CudaRuntime).
# Results (JSON + markdown) go to $OUT (default /tmp/gpu_checks). Exits non-zero on a wrong
# number, a crash or a hang.
set -uo pipefail
out=${OUT:-/tmp/gpu_checks}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
# up to 15 processes compile at once: a few Inductor compile workers each
export TORCHINDUCTOR_COMPILE_THREADS=${TORCHINDUCTOR_COMPILE_THREADS:-2}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c "import torch, sys; print('torch', torch.__version__, 'python', sys.version.split()[0])"
# the "dist" backend is an entry point of the installed package; the GPU machine has no package
# index, so instead of installing, the checkout goes on the path with the entry point beside it
site=$(mktemp -d)/site
mkdir -p "$site/dynamo_dist-0.dev0.dist-info"
printf 'Metadata-Version: 2.1\nName: dynamo_dist\nVersion: 0.dev0\n' \
    >"$site/dynamo_dist-0.dev0.dist-info/METADATA"
printf '[torch_dynamo_backends]\ndist = dynamo_dist.backend:dist_backend\n' \
    >"$site/dynamo_dist-0.dev0.dist-info/entry_points.txt"
export PYTHONPATH="$PWD:$site${PYTHONPATH:+:$PYTHONPATH}"
python3 -c "import torch; assert 'dist' in torch._dynamo.list_backends()" || exit 1

budget=${GPU_CHECKS_SECONDS:-330}
zoo() {  # $1: tag, rest: zoo arguments
    local tag=$1; shift
    timeout "$budget" python3 -m dynamo_dist.testing.zoo --runtimes cuda --timeout 240 \
        --out "$out/zoo-$tag.md" --json "$out/zoo-$tag.json" "$@" >"$out/zoo-$tag.log" 2>&1
    echo "zoo $tag: rc $?"
}
models=(${GPU_CHECKS_MODELS:-})  # a subset of the zoo's architectures (default: all)
zoo world1 --meshes tp=1 --jobs "${GPU_CHECKS_JOBS:-3}" ${models:+--models "${models[@]}"} &
if [ "$(nvidia-smi -L | wc -l)" -ge 4 ]; then
    zoo dpxtp --meshes dp=2,tp=2 --jobs 2 ${models:+--models "${models[@]}"} &
    timeout "$budget" python3 -m torch.distributed.run --standalone --nproc-per-node 4 \
        tests/mp/train_parity.py --model llama --mesh dp=2,tp=2 --layers 4 --device cuda \
        >"$out/llama-dpxtp.log" 2>&1
    echo "llama dp=2 x tp=2, 4 layers: rc $?"
    grep -h "PARITY\|PREFETCHED\|OUTLINED\|Error" "$out/llama-dpxtp.log" | head -20
else
    echo "fewer than 4 GPUs: the dp=2 x tp=2 checks need one per rank; skipped"
fi
wait
cat "$out"/zoo-*.log | grep -v "^\s*$" | tail -40
! grep -q "WRONG\|crash\|hang" "$out"/zoo-*.log
