"""KV tiers below the pool: host memory and disk, keyed by the pool's chained page hash.

``KVTiers`` (``tiers.py``) is what the page manager and the scheduler call; ``HostTier`` and
``DiskTier`` keep one tier's books each; ``Mover`` copies pages off the step thread. See
``docs/kv-tiers.md``.
"""
