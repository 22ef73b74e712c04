"""An intentional out-of-memory error outside the sweep, caught and its memory released, for benchmarks/gpu/check.py.

The allocator is capped a little above what the model already holds (kvbench.measure.memory_pressure) and given a
prompt whose forward cannot fit under it. Writes one JSON object: whether the error came, its first line, the cap,
and the bytes allocated before and after.

usage: python benchmarks/gpu/oom.py OUT/oom.json [--model random:llama-3-8b] [--tokens 131072]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from kvbench.measure import memory_pressure
from kvbench.models import load_model
from kvbench.policies import build_policy
from kvbench.session import RunSettings, generate

# room above what the model holds: a 128k-token prompt's activations need tens of GiB (one MLP input of
# Llama-3-8B alone: 131072 x 14336 x 2 bytes = 3.5 GiB)
HEADROOM = 2 * 2**30


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("output", type=Path)
    parser.add_argument("--model", default="random:llama-3-8b")
    parser.add_argument("--tokens", type=int, default=131072)
    args = parser.parse_args()
    lm = load_model(args.model, dtype="bfloat16", device="cuda")
    ids = [i % 256 for i in range(args.tokens)]  # byte tokens: within every vocabulary
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated(lm.device)
    cap = torch.cuda.memory_reserved(lm.device) + HEADROOM
    message = None
    with memory_pressure(lm.devices, limit_bytes=cap):
        try:
            generate(lm, build_policy("full"), ids, [], RunSettings(), max_new_tokens=1)
        except torch.OutOfMemoryError as exc:
            message = str(exc).splitlines()[0][:200]
    # memory_pressure emptied the cache on leaving, after the failed forward's tensors went with its traceback
    result = {"model": args.model, "tokens": args.tokens, "cap_bytes": cap, "caught": message is not None,
              "message": message, "allocated_before": before, "allocated_after": torch.cuda.memory_allocated(lm.device)}
    args.output.write_text(json.dumps(result, indent=2) + "\n")
    print(f"intentional OOM: {'caught: ' + message if message else 'did NOT happen'}")


if __name__ == "__main__":
    main()
