"""The vLLM side: the KV connector and what it hands from scheduler to workers."""
