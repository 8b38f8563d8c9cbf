"""Confidence calibration: recorded speculative rounds, Sequential Temperature Scaling, metrics, plots."""
