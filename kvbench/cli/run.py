"""`kvbench run`: policies on one task, without a run folder."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import typer

from kvbench.cli.app import (
    DTYPE,
    PLUGINS,
    app,
    json_flag,
    json_out,
    parse_assignments,
    parse_budget,
    policy_params,
    progress_bar,
    stdout,
    user_errors,
    write_json,
)
from kvbench.errors import KvbenchError

if TYPE_CHECKING:
    from kvbench.config.cells import Cell
    from kvbench.engine.models import LoadedModel
    from kvbench.engine.settings import RunSettings
    from kvbench.policies import Policy
    from kvbench.tasks import Sample, Task


@app.command()
@user_errors
def run(
    model: str = typer.Option("smollm2-135m", "--model", "-m", help="Hub id, local folder, .gguf file, "
                              "smollm2-135m (embedded) or random:<shape>."),
    policy: list[str] = typer.Option(["full"], "--policy", "-p", help="Policy name; repeat to compare several."),
    param: list[str] = typer.Option([], "--param", help="Policy parameter k=v (or policy.k=v); repeatable."),
    budget: list[str] = typer.Option(["0.25"], "--budget", "-b", help="Tokens per layer and KV head (128), "
                                     "a ratio of the prompt (0.25 or 25%) or threshold=0.01 (keep what the policy's "
                                     "normalised score puts at or above it); repeatable."),
    task: str = typer.Option("niah", "--task", "-t", help="Task name (see `kvbench tasks`)."),
    task_param: list[str] = typer.Option([], "--task-param", help="Task parameter k=v; repeatable."),
    context: list[int] = typer.Option([1024], "--context", "-c", help="Context length in tokens; repeatable."),
    depth: list[float] = typer.Option([], "--depth", help="Needle depth in [0, 1]; repeatable (niah)."),
    samples: int = typer.Option(1, "--samples", "-n", min=1, help="Samples per context length (and depth)."),
    prefill: str = typer.Option("full", "--prefill", help="full: one forward, then compress; chunked: "
                                "compress after every --prefill-chunk tokens."),
    prefill_chunk: int = typer.Option(512, "--prefill-chunk", min=1, help="Chunk size for --prefill chunked."),
    question: str = typer.Option("aware", "--question", help="aware: question inside the compressed prompt; "
                                 "agnostic: context compressed first, question appended after."),
    evict_every: int = typer.Option(1, "--evict-every", min=1, help="Decode-time slack: evict once this "
                                    "many tokens exceed the budget."),
    max_new_tokens: int | None = typer.Option(None, "--max-new-tokens", min=1, help="Override the task's."),
    dtype: str = DTYPE,
    device: str = typer.Option("auto", "--device", help="auto, cpu, cuda, cuda:N."),
    device_map: str | None = typer.Option(None, "--device-map", help="'auto' to spread a large model over GPUs."),
    seed: int = typer.Option(0, "--seed", help="Seed for sample generation and random weights."),
    plugins: str | None = PLUGINS,
    compile_steps: bool = typer.Option(False, "--compile", help="Compile each static decode step into one graph "
                                       "(torch.compile; CUDA graphs on a GPU): faster steps, the same records."),
    fidelity: bool = typer.Option(False, "--fidelity", help="Run a full cache in lockstep and record KL, top-1 "
                                  "agreement, first divergence and attention recall (about one more decode per step)."),
    as_json: bool = json_flag("one JSON record per sample (a line each, as each finishes)"),
    json_path: Path | None = json_out("the JSON records, one per line,"),
    reference: bool = typer.Option(True, "--reference/--no-reference", help="Also run `full` on each sample: the "
                                   "row the policies compare with, as a sweep's summary has it."),
) -> None:
    """Compare policies on one task: quality, speed, cache memory.

    Each policy runs beside `full` on the same samples, without a run folder."""
    from kvbench.config.cells import expand
    from kvbench.config.schema import ModelConfig, PolicySpec, PrefillConfig, SweepConfig, TaskSpec
    from kvbench.engine.estimate import canonical_dtype
    from kvbench.policies import build_policy
    from kvbench.policies.budgets import budget_description
    from kvbench.registry import load_plugins
    from kvbench.tasks import build_task

    if plugins:
        load_plugins(plugins)
    budgets = [parse_budget(b) for b in budget]
    routed = policy_params(policy, parse_assignments(param, "--param"))
    names = list(dict.fromkeys(["full", *policy] if reference else policy))
    for name in names:  # an unknown policy or parameter stops here, before it reaches a cell
        build_policy(name, routed.get(name, {}))
    task_params = parse_assignments(task_param, "--task-param")
    if depth:
        task_params["depths"] = depth
    task_obj = build_task(task, task_params)
    if any(c < 1 for c in context):
        raise KvbenchError(f"context lengths must be positive, got {context}")
    # the options checked here their own way, so the grid is built from them as they are (prefill and question stay
    # text: the cells' settings check them and name the allowed values); a sweep's expansion makes the cells
    grid = SweepConfig.model_construct(
        name="run", model=ModelConfig.model_construct(id=model, dtype=canonical_dtype(dtype), device=device,
                                                      device_map=device_map),
        policies=[PolicySpec.model_construct(name=name, **routed.get(name, {})) for name in names],
        budgets=[budget_description(b) for b in budgets], context_lengths=context,
        tasks=[TaskSpec.model_construct(name=task, **task_params)],
        prefill=PrefillConfig.model_construct(mode=cast(Any, prefill), chunk=prefill_chunk),
        question=[cast(Any, question)],
        samples=samples, seed=seed, evict_every=evict_every, max_new_tokens=max_new_tokens,
        diagnostics=["fidelity"] if fidelity else [])
    cells = expand(grid)
    runs = _checked_runs(cells)

    from kvbench.engine.models import load_model

    lm = load_model(model, dtype=dtype, device=device, device_map=device_map, seed=seed, compile=compile_steps)
    records = _evaluate_all(lm, task_obj, _sample_work(lm, task_obj, cells), runs, as_json)
    write_json("\n".join(json.dumps(record) for record in records), json_path)
    if not as_json:
        from kvbench.analysis.tables import summary_table

        stdout.print(summary_table(records, lm.describe()))


def _checked_runs(cells: list[Cell]) -> dict[str, tuple[Policy, RunSettings]]:
    """Each cell's policy and settings, by cell id; a token budget or a threshold a policy cannot take stops here,
    before the model loads (a ratio is checked against each prompt)."""
    from kvbench.policies.base import Demand
    from kvbench.policies.budgets import Threshold

    runs: dict[str, tuple[Policy, RunSettings]] = {}
    for cell in cells:
        pol, setting = cell.policy(), cell.settings()
        pol.check(Demand(setting.budget if isinstance(setting.budget, int) else None,
                         isinstance(setting.budget, Threshold), setting.prefill == "chunked"))
        runs[cell.id] = pol, setting
    return runs


def _sample_work(lm: LoadedModel, task: Task, cells: list[Cell]) -> list[tuple[Cell, Sample]]:
    """Every (cell, sample) to run, sample by sample: the cells of one sample group see the same samples."""
    groups: dict[tuple, list[Cell]] = {}
    for cell in cells:
        groups.setdefault(cell.group, []).append(cell)
    work: list[tuple[Cell, Sample]] = []
    for group in groups.values():
        first = group[0].description
        for sample in task.samples(lm.tokenizer, first["context_length"], first["samples"], first["seed"]):
            work.extend((cell, sample) for cell in group)
    return work


def _evaluate_all(lm: LoadedModel, task: Task, work: list[tuple[Cell, Sample]],
                  runs: dict[str, tuple[Policy, RunSettings]], as_json: bool) -> list[dict[str, Any]]:
    """The records of `work` in order, with a progress bar; each printed as a JSON line as it finishes with
    `as_json`."""
    from kvbench.runs.runner import evaluate

    records = []
    with progress_bar(disable=False) as progress:
        bar = progress.add_task("samples", total=len(work))
        for cell, sample in work:
            d = cell.description
            progress.update(bar, description=f"{d['policy']['name']} L={d['context_length']}")
            pol, setting = runs[cell.id]
            record = evaluate(lm, task, pol, sample, setting, d["context_length"], d["seed"])
            records.append(record)
            if as_json:
                sys.stdout.write(json.dumps(record) + "\n")
                sys.stdout.flush()
            progress.advance(bar)
    return records
