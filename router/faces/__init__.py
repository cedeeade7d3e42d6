"""What faces the clients: vLLM's own OpenAI server as the HTTP face (vllm_face.py, with the
pools' routes beside it in openai_http.py), the gRPC API (grpc_api.py), the bounds on
connections (connections.py) and the API key (auth.py). These may load vLLM, gRPC and uvicorn;
nothing else in router/ does."""
