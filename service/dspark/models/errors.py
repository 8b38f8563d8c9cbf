"""The error every model-loading step raises for a model it cannot fetch, verify or load."""

from __future__ import annotations


class ModelError(RuntimeError):
    """A model cannot be fetched, verified or loaded; the message says why."""
