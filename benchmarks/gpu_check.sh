#!/usr/bin/env bash
# The CUDA path in one go (under 8 minutes on one large GPU): device facts, `kvbench estimate`, a timed
# sweep with NVML traces, a memory-pressure sweep ending in OOMs, an intentional OOM outside the sweep,
# and one summary. Output goes to $1 (default benchmarks/results/gpu-<date>); commit its check.log.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-benchmarks/results/gpu-$(date +%F)}
mkdir -p "$out"
kvbench=${KVBENCH:-.venv/bin/kvbench}
python=${PYTHON:-.venv/bin/python}
{
  echo "# kvbench GPU check, $(date -u +%FT%TZ)"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  "$python" -c "import torch, pynvml; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'nvml ok')"
  "$kvbench" estimate llama-3.2-1b -c 4096 -c 32768 --dtype bfloat16 -b 1024 --device-memory 140GiB
  time "$kvbench" sweep benchmarks/gpu/sweep.yaml -o "$out/sweep" --trace -q --force
  time "$kvbench" sweep benchmarks/gpu/pressure.yaml -o "$out/pressure" -q --force
  "$python" - <<'PY'
import torch
from kvbench.models import load_model
from kvbench.policies import build_policy
from kvbench.session import RunSettings, generate
lm = load_model("random:llama-3.2-1b", dtype="bfloat16", device="cuda")
free = torch.cuda.mem_get_info()[0]
ids = list(range(1000, 1000 + 131072))  # 128k tokens in one forward: the prompt alone outgrows the cap
torch.cuda.set_per_process_memory_fraction(0.05)
try:
    generate(lm, build_policy("full"), ids, [], RunSettings(), max_new_tokens=1)
    print("intentional OOM: did NOT happen")
except torch.OutOfMemoryError as exc:
    print("intentional OOM: caught:", str(exc).splitlines()[0][:120])
finally:
    torch.cuda.set_per_process_memory_fraction(1.0)
    torch.cuda.empty_cache()
print(f"after release: {torch.cuda.memory_allocated() / 2**30:.2f} GiB allocated, free before {free / 2**30:.1f} GiB")
PY
  cat "$out/sweep/summary.md" "$out/pressure/summary.md"
  "$python" - "$out" <<'PY'
import json, sys, pathlib
out = pathlib.Path(sys.argv[1])
gib = lambda v: "" if v is None else f"{v / 2**30:.2f}"
print("\n| run | policy | context | memory | status | decode tok/s [min, max] | alloc / reserved / device peak GiB |")
print("|---|---|---:|---|---|---:|---:|")
for run in ("sweep", "pressure"):
    for line in (out / run / "records.jsonl").read_text().splitlines():
        r = json.loads(line)
        low, high = r.get("decode_tok_s_spread") or (None, None)
        spread = "" if low is None else f" [{low:.0f}, {high:.0f}]"
        print(f"| {run} | {r['policy']['name']} | {r['context_length']} | {r['cell'].get('memory', '-')} | ok | "
              f"{r['decode_tok_s'] or 0:.0f}{spread} | {gib(r['mem_peak_alloc'])} / {gib(r['mem_peak_reserved'])} / "
              f"{gib(r['mem_peak_device'])} |")
    for line in (out / run / "cells.jsonl").read_text().splitlines():
        c = json.loads(line)
        if c["status"] != "ok":
            print(f"| {run} | {c['cell']['policy']['name']} | {c['cell']['context_length']} | "
                  f"{c['cell'].get('memory', '-')} | {c['status']}: {c['message'][:70]} | | |")
PY
} 2>&1 | tee "$out/check.log"
