"""kvbench: benchmark KV-cache eviction and compression policies on real models."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("kvbench")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0.0.0+source"
