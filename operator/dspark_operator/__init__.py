"""Kubernetes operator for DSparkService resources."""

__version__ = "0.1.0"
