"""Built-in KV-cache policies, one file each. `BUILT_IN` names the module that registers each: a policy's module is
imported the first time its name is read (`POLICIES.get`, `build_policy`), so a run imports the policies it runs.
A new policy is its file and its line here (tests/test_registry.py checks the index against the files).

The folder also holds the policy contract, which sits below the engine that drives it: `base` (`Policy`, its hooks
and kinds), `schedule`, `budgets` (token, ratio and threshold budgets), `reference` (each policy's rule written from
its definition, what `kvbench check` holds the engine to), `deprecated` and `full` (the reference every run is
compared with): it imports only kvbench's core. The policies themselves run on the engine: a policy may import
the contract, the engine and kvbench/calibration/."""

from kvbench.policies.base import POLICIES, Demand, Policy, Schedule, build_policy, register

BUILT_IN = {name: f"kvbench.policies.{module}" for name, module in {
    "ada_kv": "ada_kv", "adaptive": "adaptive", "chunkkv": "chunkkv", "compose": "compose", "hybrid": "compose",
    "criticalkv": "criticalkv", "duoattention": "duoattention", "expected_attention": "expected_attention",
    "expected_attention_stats": "expected_attention", "full": "full", "h2o": "h2o", "keydiff": "keydiff",
    "knorm": "knorm", "kvzap": "kvzap", "kvzip": "kvzip", "kvzip_plus": "kvzip", "lagkv": "lagkv", "lowrank": "lowrank",
    "merge": "merge", "mixed_precision": "mixed_precision", "pyramidkv": "pyramidkv", "qfilter": "qfilter",
    "quant": "quant", "quest": "quest", "random": "random", "razorattention": "razorattention", "rkv": "rkv",
    "scissorhands": "scissorhands", "simlayerkv": "simlayerkv", "snapkv": "snapkv", "streaming_llm": "streaming_llm",
    "think": "think", "tova": "tova", "whole_segments": "whole_segments", "window": "window",
}.items()}
POLICIES.index(BUILT_IN)

__all__ = ["BUILT_IN", "POLICIES", "Demand", "Policy", "Schedule", "build_policy", "register"]
