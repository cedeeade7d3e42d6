"""`pdserve bench`: a load generator and report for OpenAI-compatible endpoints.

workload.py builds the requests and their arrival times, client.py sends them (streamed, SSE) and
times every token, stats.py turns the records into percentiles and goodput, report.py writes
JSON, markdown and plots, and compare.py runs one workload against pdserve disaggregated and
colocated on the same cores (and a plain vLLM server for the router's overhead).
"""
