"""asyncio sources of the I/O classes (the sync twins are generated)."""
