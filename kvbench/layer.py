"""Moved to kvbench/engine/layer.py (the engine's folder). `kvbench.layer` is the same module:
plugins that import it keep working."""

import sys

from kvbench.engine import layer

sys.modules[__name__] = layer
