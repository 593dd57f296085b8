"""The package's version, one source for `pdserve --version`, `/version` and `/server_info`: the installed
distribution's metadata (pyproject.toml's `version`)."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

try:
    VERSION = version("pdserve")
except PackageNotFoundError:  # run from a source tree that was never installed
    VERSION = "0+unknown"
