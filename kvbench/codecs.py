"""Moved to kvbench/engine/codecs.py (the engine's folder). `kvbench.codecs` is the same module:
plugins that import it keep working."""

import sys

from kvbench.engine import codecs

sys.modules[__name__] = codecs
