"""Prompt sets: small built-in ones for quick benchmarks, held-out evaluation sets from installed packages."""
