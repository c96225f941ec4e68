"""MOSAIC: the planner (search, MINLP, plans, exports, CLI) and the bundled trainer."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("mosaic-planner")
except PackageNotFoundError:  # running from a source tree without install
    __version__ = "0.0.0+local"
