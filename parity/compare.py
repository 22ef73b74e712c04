"""The kvbench side of the parity check, and the verdict (kvbench's environment):

    python -m parity.compare WORK [--markdown FILE] [--case NAME ...]   # reads WORK/kvpress.pt (parity.run_kvpress)

Runs every case of parity/cases.yaml through kvbench on the same models and prompts, compares the positions each
(prompt, layer, KV head) holds (or the key channels it keeps) with kvpress's, prints one line per case and exits 1
when any case is below its tolerance.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers
import yaml

from kvbench.checks.suite import kept_channels, kept_masks
from kvbench.engine.models import load_model
from kvbench.engine.session import Session
from kvbench.engine.settings import RunSettings
from kvbench.policies.base import build_spec
from kvbench.policies.budgets import Threshold
from parity import ARTIFACT_PARAMS, artifact_folder, kept_per_head, pattern_folder

CASES = Path(__file__).with_name("cases.yaml")


@dataclass
class Agreement:
    case: str
    model: str
    mean: float
    worst: float
    kept_kvbench: int  # entries held, summed over prompts, layers and heads
    kept_kvpress: int


def agreement(ours: torch.Tensor, theirs: torch.Tensor, kind: str) -> torch.Tensor:
    """Per KV head `[heads]`: Jaccard of the held positions (of the kept key channels for `channels`), or `nested`
    overlap (of the smaller set)."""
    common = (ours & theirs).sum(-1).double()
    if kind == "nested":
        return common / torch.minimum(ours.sum(-1), theirs.sum(-1)).clamp_min(1)
    return common / (ours | theirs).sum(-1).clamp_min(1)


def kvbench_masks(lm, spec: dict, prompt: list[int], budget: int | Threshold, kind: str) -> list[torch.Tensor]:
    """Per layer, the `[kv_heads, prompt]` positions kvbench holds, or its `[kv_heads, head_dim]` key channels."""
    policy = build_spec(spec)
    settings = RunSettings(budget=budget if policy.schedule.evicts else None)
    session = Session(lm, policy, settings, prompt_tokens=len(prompt))
    session.prefill(prompt)
    return kept_channels(session.cache) if kind == "channels" else kept_masks(session.cache)


def compare(work: Path, config: dict) -> list[Agreement]:
    theirs = torch.load(work / "kvpress.pt")
    prompts = json.loads((work / "prompts.json").read_text())
    rows = []
    for model in config["models"]:
        name = model["name"]
        lm = load_model(str(work / "models" / name), dtype="float32", device="cpu")
        for case in config["cases"]:
            scores, ours_kept, theirs_kept = [], 0, 0
            spec, window = case["kvbench"], case.get("pattern")
            if window is not None:  # the same pattern file, at the budget its window keeps
                spec = {**spec, "pattern": str(pattern_folder(work, case, name))}
            if "calibrated" in case:  # the same artifact folder kvpress loads
                spec = {**spec, ARTIFACT_PARAMS[case["calibrated"]]: str(artifact_folder(work, case, name))}
            for prompt, their_masks in zip(prompts[name], theirs[name][case["name"]], strict=True):
                if "threshold" in case:
                    budget: int | Threshold = Threshold(case["threshold"])
                elif window is not None:
                    budget = window["sink_size"] + window["recent_size"]
                else:
                    budget = kept_per_head(config, len(prompt), case)
                our_masks = kvbench_masks(lm, spec, prompt, budget, case["agreement"])
                for ours, other in zip(our_masks, their_masks, strict=True):
                    scores.append(agreement(ours, other, case["agreement"]))
                    ours_kept, theirs_kept = ours_kept + int(ours.sum()), theirs_kept + int(other.sum())
            values = torch.cat(scores)
            rows.append(Agreement(case["name"], name, values.mean().item(), values.min().item(), ours_kept,
                                  theirs_kept))
    return rows


def verdicts(rows: list[Agreement], config: dict) -> list[tuple[Agreement, bool]]:
    limits = {case["name"]: case for case in config["cases"]}
    return [(row, row.mean >= limits[row.case]["min_mean"] and row.worst >= limits[row.case]["min_worst"])
            for row in rows]


def markdown(judged: list[tuple[Agreement, bool]], config: dict) -> str:
    """One row per case: its agreement on each model as `mean (worst)`, the tolerance and the reason."""
    models = [model["name"] for model in config["models"]]
    cells = {(row.case, row.model): f"{row.mean:.4f} ({row.worst:.4f})" + ("" if passed else " **fails**")
             for row, passed in judged}
    lines = [f"| policy | kvpress press | agreement | {' | '.join(models)} | tolerance: mean (worst) | why not 1 |",
             f"|---|---|---|{'---:|' * len(models)}---|---|"]
    for case in config["cases"]:
        press = case["kvpress"]
        inner = f"({press['press']['class']})" if "press" in press else ""
        agreements = " | ".join(cells.get((case["name"], model), "-") for model in models)
        lines.append(f"| `{case['name']}` | `{press['class']}{inner}` | {case['agreement']} | {agreements} | "
                     f"{case['min_mean']} ({case['min_worst']}) | {case['reason']} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("work", type=Path)
    parser.add_argument("--markdown", type=Path, help="also write the table as Markdown")
    parser.add_argument("--case", action="append", help="only this case (repeatable)")
    args = parser.parse_args()
    transformers.utils.logging.disable_progress_bar()
    config = yaml.safe_load(CASES.read_text())
    if args.case:
        config["cases"] = [case for case in config["cases"] if case["name"] in args.case]
    judged = verdicts(compare(args.work, config), config)
    limits = {case["name"]: case for case in config["cases"]}
    for row, passed in judged:
        limit = limits[row.case]
        print(f"parity: {'ok  ' if passed else 'FAIL'} {row.case:<19} {row.model:<13} {limit['agreement']:<7} "
              f"mean {row.mean:.4f} (>= {limit['min_mean']}) worst {row.worst:.4f} (>= {limit['min_worst']}) "
              f"entries {row.kept_kvbench} / {row.kept_kvpress}")
    if args.markdown:
        args.markdown.write_text(markdown(judged, config))
    failed = [row for row, passed in judged if not passed]
    names = sorted({row.case for row in failed})
    print(f"parity: {len(judged) - len(failed)} passed, {len(failed)} failed"
          + (f" ({', '.join(names)})" if names else ""))
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
