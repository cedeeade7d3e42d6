"""The node that takes either role (`pools.autoscale`): beside prefill_node/ and decode_node/,
made of both."""
