"""asyncio sources of the conformance and backend tests (the sync twins are generated)."""
