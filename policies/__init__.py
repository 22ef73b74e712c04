"""Built-in KV-cache policies, one file each; importing this package registers them all."""

from kvbench.policies import (  # noqa: F401
    ada_kv,
    adaptive,
    chunkkv,
    compose,
    criticalkv,
    duoattention,
    expected_attention,
    full,
    h2o,
    keydiff,
    knorm,
    kvzip,
    lagkv,
    lowrank,
    merge,
    mixed_precision,
    pyramidkv,
    quant,
    quest,
    random,
    razorattention,
    rkv,
    scissorhands,
    simlayerkv,
    snapkv,
    streaming_llm,
    think,
    tova,
    window,
)
from kvbench.policies.base import POLICIES, Policy, build_policy, register

__all__ = ["POLICIES", "Policy", "build_policy", "register"]
