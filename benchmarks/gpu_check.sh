#!/usr/bin/env bash
# The CUDA path as a check, on one large GPU: device facts, `kvbench check` on a random-weight Llama-3-8B at 16k
# tokens (full against model.generate, the policies against their references, memory readings, a cap below the
# weights, an out-of-memory caught and released, the NVML sampler, decode timing), a timed sweep of the same shape at
# 32k with NVML traces, a memory-pressure sweep, a short
# service under load; then benchmarks/gpu/check.py judges what they left in OUT ($1,
# default benchmarks/results/gpu-<date>): one table, and exit 1 if anything is wrong. The log is OUT/check.log; commit
# it with OUT/check.json.
#
# Time on one H200 (16 cores), measured 2026-12-04 (benchmarks/README.md), each step killed at its budget (check.py
# then fails it), about 4.5 minutes in all:
#   facts, `kvbench estimate`  8-11 s     budget  20 s
#   kvbench check              97-113 s   budget 150 s: random init, ~25 forwards of 16k tokens
#   gpu/sweep.yaml             50-53 s    budget  80 s: random init on the GPU, 4 cells x (warm-up + timed run)
#   gpu/pressure.yaml          30-38 s    budget  60 s: 9 cells, the 99% ones out of memory at their first allocation
#   gpu/load.yaml              not yet    budget 120 s: random init, 2 cells' rate searches of 8 requests, up to
#                                         4 rates each
#   decode_step.py             not yet    budget 140 s: a 32k prefill, 4 policies' steps eager and compiled (CUDA
#                                         graphs) on the 8B shape's first 8 layers, its compiles kept short
#   check.py                   ~3 s
# KVBENCH (default .venv/bin/kvbench), PYTHON and KVBENCH_COMMIT (the commit the log names, where the folder is not a
# git checkout) say what runs.
set -uo pipefail  # no -e: a failed step is recorded in OUT/<step>.exit, and the others still run
cd "$(dirname "$0")/.."
out=${1:-benchmarks/results/gpu-$(date +%F)}
# a check measures afresh: a run folder left in OUT by an earlier check would be resumed, its cells not run again
rm -rf "$out/sweep" "$out/pressure" "$out/load" "$out/check.json" "$out/decode.json" "$out"/*.exit
mkdir -p "$out"
kvbench=${KVBENCH:-.venv/bin/kvbench}
python=${PYTHON:-.venv/bin/python}

step() {  # step NAME BUDGET_S COMMAND...: run COMMAND within its budget, its exit status in OUT/NAME.exit
    local name=$1 budget=$2 started=$SECONDS
    shift 2
    timeout "$budget" "$@"
    local status=$?
    echo "$status" >"$out/$name.exit"
    echo "# $name: exit $status after $((SECONDS - started)) s (budget $budget s)"
}

{
    echo "# kvbench GPU check, $(date -u +%FT%TZ), commit ${KVBENCH_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}"
    nvidia-smi --query-gpu=name,uuid,pci.bus_id,memory.total,driver_version,mig.mode.current --format=csv
    # the GPU machines have transformers 5.17: check.py warns when another version ran
    step facts 20 "$python" -c 'import torch, transformers, pynvml
print("torch", torch.__version__, "cuda", torch.version.cuda, "transformers", transformers.__version__, "nvml ok")'
    "$kvbench" estimate llama-3-8b -c 32768 --dtype bfloat16 -b 1024 --device-memory 140GiB
    step check 150 "$kvbench" check -m random:llama-3-8b --device cuda --dtype bfloat16 --context 16384 \
        --json-out "$out/check.json"
    step sweep 80 "$kvbench" sweep benchmarks/gpu/sweep.yaml -o "$out/sweep" --trace -q
    step pressure 60 "$kvbench" sweep benchmarks/gpu/pressure.yaml -o "$out/pressure" -q
    step load 120 "$kvbench" sweep benchmarks/gpu/load.yaml -o "$out/load" -q
    # each policy's decode step at 32k, eager and compiled (CUDA graphs), beside its bandwidth floor
    step decode 140 "$python" benchmarks/decode_step.py --model random:llama-3-8b --layers 8 --device cuda \
        --dtype bfloat16 --contexts 32768 --budget 1024 --steps 32 --policies full window snapkv h2o \
        --json-out "$out/decode.json"
    "$python" benchmarks/gpu/check.py "$out"
} 2>&1 | tee "$out/check.log"
exit "${PIPESTATUS[0]}"
