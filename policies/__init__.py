"""Built-in KV-cache policies, one file each; importing this package registers them all."""

from kvbench.policies import (  # noqa: F401
    ada_kv,
    adaptive,
    chunkkv,
    compose,
    criticalkv,
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
    random,
    rkv,
    scissorhands,
    simlayerkv,
    snapkv,
    streaming_llm,
    tova,
    window,
)
from kvbench.policies.base import POLICIES, Policy, build_policy, register

__all__ = ["POLICIES", "Policy", "build_policy", "register"]
