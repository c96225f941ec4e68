"""Errors of scaling_fits (which imports nothing else of MOSAIC).

`FitDataError` derives from `ValueError` so plain Python callers can catch it
as such; `mosaic fit` and the planner map it to the one-line ``error: ...``
convention with exit code 2. Messages name the file, column or key, and the fix.
"""

from __future__ import annotations


class FitDataError(ValueError):
    """Bad runs data, a bad fit file, or a bad argument to a law or the fitter."""


__all__ = ["FitDataError"]
