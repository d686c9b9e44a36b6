"""Experiments and their results (not part of the kvdir package)."""
