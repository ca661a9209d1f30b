"""Storage guards: they refuse every write whose fencing token is older than the fence.

Shipped as ``fence.adapters``; import them from there, e.g.
``from fence.adapters.sql import fenced_update``.
"""
