"""Generate standalone, readable PyTorch training projects from a copier template."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("scaffold")
except PackageNotFoundError:  # running from a checkout that was never installed
    __version__ = "0.0.0+unknown"
