"""asyncio sources. ``tools/async_to_sync.py`` generates ``fence._sync`` from them."""
