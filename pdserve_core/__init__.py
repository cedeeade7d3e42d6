"""What every part of pdserve stands on: the config schema, the engine actor and its types, the
KV hand-over both roles share, TLS, the cost model, and the default model's preparation.

Nothing here imports the roles (prefill_node/, decode_node/), the router (router/) or the
application (pdserve/): tests/logic/test_layering.py keeps it so."""
