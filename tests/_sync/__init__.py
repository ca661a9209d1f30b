# WARNING: this file is generated from tests/_async/__init__.py by tools/async_to_sync.py.
# Do not edit it; edit the source and run `python tools/async_to_sync.py`.
"""Conformance and backend tests; _sync is generated from _sync."""
