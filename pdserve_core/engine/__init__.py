"""The engine every node hosts: a vLLM `AsyncLLM` in a Ray actor (actor.py), its statistics
(stats.py), and the plain types that cross Ray between router and nodes (types.py).

Importing this package loads nothing heavy: types.py imports neither vLLM nor Ray."""
