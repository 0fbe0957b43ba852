"""Data plane: moving block bytes between a client's memory and a shard's pool."""
