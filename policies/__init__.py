"""Built-in KV-cache policies, one file each; importing this package registers them all."""

from kvbench.policies import full, h2o, random, snapkv, streaming_llm, window  # noqa: F401
from kvbench.policies.base import POLICIES, Policy, build_policy, register

__all__ = ["POLICIES", "Policy", "build_policy", "register"]
