"""The planner, a tool over the cost model (pdserve_core/roofline): `pdserve plan`'s P:D plan and
tables (plan.py) and the step-time model's fit from measured steps (fit.py, for
`pdserve plan calibrate`). Nothing that serves imports it."""
