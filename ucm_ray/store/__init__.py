"""The sharded block store. ``engine/`` runs in an engine's process (the client and what it
needs), ``shard/`` in the shard actors and the fleet's driver; modules here are shared by both
(value types, the ``BlockStore`` ABC, placement, checksums, the published index's layout) or,
``local``, run both halves in one process for tests."""
