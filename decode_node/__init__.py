"""Decode pool nodes: Ray actors running vLLM as KV consumers (see the disaggregation issue)."""
