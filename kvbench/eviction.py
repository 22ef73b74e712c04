"""Moved to kvbench/engine/eviction.py (the engine's folder). `kvbench.eviction` is the same module:
plugins that import it keep working."""

import sys

from kvbench.engine import eviction

sys.modules[__name__] = eviction
