"""Moved to kvbench/engine/storage.py (the engine's folder). `kvbench.storage` is the same module:
plugins that import it keep working."""

import sys

from kvbench.engine import storage

sys.modules[__name__] = storage
