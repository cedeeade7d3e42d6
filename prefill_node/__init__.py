"""Prefill pool nodes: Ray actors running vLLM as KV producers (see the disaggregation issue)."""
