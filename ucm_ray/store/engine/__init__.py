"""The store's engine side: what runs in an engine's process (the Ray client, slot supply,
membership feed, call poster, touches, published-index readers). Never imports ``store.shard``."""
