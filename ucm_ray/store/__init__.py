"""The sharded block store: index, placement, shard actors, directory, client."""
