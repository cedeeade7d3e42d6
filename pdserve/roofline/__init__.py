"""Roofline model (DESIGN.md §1): model specs × device specs → intensity, ridge, sizes, times.

Used by `pdserve plan`, by `serve` for its default chunk size, and by the utilization metrics.
"""
