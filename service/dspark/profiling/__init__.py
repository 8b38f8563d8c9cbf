"""Engine step-rate profiles (SPS curves): format, lookup, online refinement, plots.

Submodules are imported directly (`dspark.profiling.sps_profile`, `.online`, `.plots`, ...):
the profile format stays importable without torch.
"""
