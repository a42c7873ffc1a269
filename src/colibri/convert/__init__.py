"""Checkpoint -> container: the conversion pipeline, calibration, mixed precision, tied tables."""
