"""asyncio sources of the storage guards (the sync twins are generated)."""
