"""The router: the one process clients talk to (OpenAI HTTP and gRPC); it owns the pools."""
