"""Roofline model: model specs × device specs → intensity, ridge, sizes, times (docs/design.md,
"The planner's model").

Used by `pdserve plan`, by `serve` for its default chunk size, and by the utilization metrics.
"""
