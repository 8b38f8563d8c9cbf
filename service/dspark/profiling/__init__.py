"""Engine step-rate profiles (SPS curves): format, lookup, online refinement, plots."""

from dspark.profiling.online import OnlineSps
from dspark.profiling.sps_profile import ProfileError, SpsCurve, SpsPoint, SpsProfile, default_profile_path

__all__ = ["OnlineSps", "ProfileError", "SpsCurve", "SpsPoint", "SpsProfile", "default_profile_path"]
