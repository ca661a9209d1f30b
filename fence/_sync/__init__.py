# WARNING: this file is generated from fence/_async/__init__.py by tools/async_to_sync.py.
# Do not edit it; edit the source and run `python tools/async_to_sync.py`.
"""asyncio sources. ``tools/async_to_sync.py`` generates ``fence._sync`` from them."""
