"""Coral: cost-efficient multi-LLM serving over heterogeneous cloud GPUs (README.md)."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("coral")
except PackageNotFoundError:  # a source tree that is not installed
    __version__ = "0+unknown"
