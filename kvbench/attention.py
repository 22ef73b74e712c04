"""Moved to kvbench/engine/attention.py (the engine's folder). `kvbench.attention` is the same module:
plugins that import it keep working."""

import sys

from kvbench.engine import attention

sys.modules[__name__] = attention
