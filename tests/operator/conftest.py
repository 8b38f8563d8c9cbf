"""Operator tests: short intervals and no metrics port, set before the handlers module is imported."""

import os

os.environ.setdefault("DSPARK_OPERATOR_RECONCILE_SECONDS", "0.3")
os.environ.setdefault("DSPARK_OPERATOR_AUTOSCALE_TICK_SECONDS", "0.2")
os.environ.setdefault("DSPARK_OPERATOR_METRICS_PORT", "0")
os.environ.setdefault("DSPARK_OPERATOR_PROFILE_TIMEOUT_GRACE_SECONDS", "0")
