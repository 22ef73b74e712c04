"""Built-in tasks, one file per family. `BUILT_IN` names the module that registers each, imported the first time
its name is read (`TASKS.get`, `build_task`) (tests/test_registry.py checks the index against the files).

Beside the families: `base` (the `Task` contract), `corpus`, `words` and `metrics` (what several families share),
`capacity_search` (the largest batch or context that fits, which the capacity task and `kvbench capacity` run) and
`lmeval_model` (lm-evaluation-harness's model `kvbench`, which the lm_eval task and `kvbench lm-eval` run). A task
may import the engine and the policy contract; a policy it names, it builds through the registry."""

from kvbench.tasks.base import TASKS, Sample, Task, build_task, encode_prompt, register

BUILT_IN = {name: f"kvbench.tasks.{module}" for name, module in {
    "capacity": "capacity", "dialogue": "dialogue", "fewshot": "fewshot", "instructions": "instructions",
    "lm_eval": "lmeval", "longbench": "longbench", "longgen": "longgen", "multiquery": "multiquery", "niah": "niah",
    "perplexity": "perplexity", "ruler": "ruler",
}.items()}
TASKS.index(BUILT_IN)

__all__ = ["BUILT_IN", "TASKS", "Sample", "Task", "build_task", "encode_prompt", "register"]
