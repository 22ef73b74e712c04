"""Moved to kvbench/engine/rows.py (the engine's folder). `kvbench.rows` is the same module:
plugins that import it keep working."""

import sys

from kvbench.engine import rows

sys.modules[__name__] = rows
