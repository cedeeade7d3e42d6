"""pdserve: disaggregated prefill/decode LLM serving on Ray and vLLM."""

__version__ = "0.1.0"

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
"""How every pdserve process logs (a router of several prefixes its number)."""
