"""The decode pool's node role: pulls a prefill's KV into its own paged cache and decodes the
rest of the request (node.py: the actor; kv_consumer.py: the connector's consumer half;
kv_client.py: one pull from a prefill node's KV server)."""
