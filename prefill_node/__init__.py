"""The prefill pool's node role: runs prompts, samples the first token, and serves the KV it
computed to decode nodes (node.py: the actor; kv_producer.py: the connector's producer half;
kv_server.py: the KV server; leases.py: the blocks held for decode nodes)."""
