"""What decides, as pure functions and small state over the router's counts: where a request
runs (routing.py, placement.py, policies.py, prefixes.py), where a split request's seam falls
(seam.py), whether a failed run runs again (retry.py), whether a request is admitted
(admission.py), and when nodes move between pools (autoscale.py). Nothing here does I/O."""
