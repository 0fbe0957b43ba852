"""ucm-ray: a distributed KV-cache tier for vLLM, sharded across a Ray cluster."""

__version__ = "0.1.0"
