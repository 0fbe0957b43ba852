"""The store's shard side: the shard actor and what it holds (index, allocator, published-index
writer), the directory actor and the fleet's start/stop. Never imports ``store.engine``."""
