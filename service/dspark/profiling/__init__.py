"""Measure an engine's step rate against the tokens in a forward (the SPS profile), find or
measure the profile an engine starts with, and plot it."""
