"""Built-in tasks, one file per family; importing this package registers them all."""
from kvbench.tasks import (  # noqa: F401
    capacity,
    dialogue,
    fewshot,
    instructions,
    lmeval,
    longbench,
    longgen,
    multiquery,
    niah,
    perplexity,
    ruler,
)
from kvbench.tasks.base import TASKS, Sample, Task, build_task, encode_prompt, register

__all__ = ["TASKS", "Sample", "Task", "build_task", "encode_prompt", "register"]
