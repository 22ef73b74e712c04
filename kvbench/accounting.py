"""Moved to kvbench/engine/accounting.py (the engine's folder). `kvbench.accounting` is the same module:
plugins that import it keep working."""

import sys

from kvbench.engine import accounting

sys.modules[__name__] = accounting
