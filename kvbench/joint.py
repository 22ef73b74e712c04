"""Moved to the engine's folder: the joint cache to kvbench/engine/joint.py, a joint step to kvbench/engine/session.py;
these names keep working."""

from kvbench.engine.joint import JointCache
from kvbench.engine.session import step_together

__all__ = ["JointCache", "step_together"]
