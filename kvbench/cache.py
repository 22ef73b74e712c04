"""Moved to kvbench/engine/cache.py (the engine's folder). `kvbench.cache` is the same module:
plugins that import it keep working."""

import sys

from kvbench.engine import cache

sys.modules[__name__] = cache
