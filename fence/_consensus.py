"""What the managers whose tokens come from a consensus engine share, without I/O.

The etcd manager (``fence._async.etcd``) and the ZooKeeper manager
(``fence._async.zookeeper``) build a client of a cluster before the generic manager sees
their options; the checks and defaults they share are here, once.
"""

from __future__ import annotations

from fence._core import client_deadline, validate_ttl

__all__ = ["lease_settings"]


def lease_settings(
    ttl: float, drift: float, margin: float, request_timeout: float | None
) -> tuple[float, float]:
    """The lease time and the request timeout of a consensus manager, checked before any
    client of the cluster exists.

    Args:
        ttl: the default lease time, in seconds.
        drift: the fraction of ttl the client gives up for clock rate differences (C10).
        margin: the seconds the client gives up for the request's own latency (C10).
        request_timeout: how long one call may take, in seconds; ``None``: a third of the
            ttl, between 1 and 5 s.

    Returns:
        ``(ttl, request_timeout)``.

    Raises:
        ConfigurationError: the ttl, drift and margin leave no valid lease time.
    """
    ttl = validate_ttl(ttl)
    client_deadline(0.0, ttl, drift=drift, margin=margin)
    if request_timeout is None:
        request_timeout = min(5.0, max(1.0, ttl / 3))
    return ttl, request_timeout
