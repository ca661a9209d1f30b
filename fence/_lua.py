"""A Lua script as Redis runs it: a name, the source and its SHA1. No I/O.

Every script iofence sends is one :class:`Script`, built once when its module is imported:
the Redis lock manager's (:mod:`fence._redis_scripts`), the quorum's (:mod:`fence._quorum`)
and the Redis guard's (``adapters/_redis_lua.py``). A call names the script by its SHA1
(``EVALSHA``), so the source crosses the wire only when a server does not know it: on a
``NOSCRIPT`` reply (a restart, a failover, ``SCRIPT FLUSH``) the caller sends
``SCRIPT LOAD`` with :attr:`Script.source` and the call again, and never reports the
``NOSCRIPT`` as a verdict on the call.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

__all__ = ["Script"]


@dataclass(frozen=True, slots=True)
class Script:
    """A Lua script and its SHA1, for ``EVALSHA`` with a reload on ``NOSCRIPT``.

    Attributes:
        name: a short name for messages.
        source: the Lua source.
        sha: the SHA1 hex digest ``EVALSHA`` names it by.
    """

    name: str
    source: str
    sha: str

    @classmethod
    def of(cls, name: str, source: str) -> Script:
        """Build a script and compute its SHA1 (of the UTF-8 source, as Redis does)."""
        # Redis names scripts by their SHA1; it is an identifier here, not a security measure.
        digest = hashlib.sha1(source.encode("utf-8"), usedforsecurity=False)
        return cls(name, source, digest.hexdigest())
