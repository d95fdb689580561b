"""The coordinator's API wing: the public gRPC API (grpc_api.py), the OpenAI-compatible HTTP API
(openai_api.py, openai_schema.py, http_server.py), request validation (validation.py), admission control
(admission.py), and the one generation path they share (frontend.py)."""
