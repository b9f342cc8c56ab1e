"""The OpenAI-compatible HTTP gateway: a fourth process that speaks the API every
OpenAI client already has (/v1/chat/completions, /v1/completions, /v1/models)
and translates it to the orchestrator's public gRPC API.

It holds no model and no session state, so it scales on its own: any number of
gateway replicas in front of any number of orchestrators. It imports only the
core `specmesh` package.
"""
