"""The cost model: model specs × device specs → intensity, ridge, sizes, times (specs.py,
model.py; docs/design.md, "The planner's model"), the calibrated step-time model (stepmodel.py),
live step pricing (live.py) and the default chunk size (serving.py).

The ground the runtime and the tools share: engines price their steps with it (the utilization
and predicted step-time metrics), `serve` takes its default chunk size from it, and the planner
(pdserve/planner), the bench and the simulator build on it.
"""
