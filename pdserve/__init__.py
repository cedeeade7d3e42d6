"""pdserve: disaggregated prefill/decode LLM serving on Ray and vLLM."""

__version__ = "0.1.0"
