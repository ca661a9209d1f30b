"""``redis+sentinel://`` URLs: which Sentinels to ask for which primary, without I/O.

The form is the one the Python tools that read Sentinel URLs agree on (it extends
``redis://`` the way ``redis+cluster://`` does)::

    redis+sentinel://[[user]:password@]host[:port][,host2[:port2]...]/service[/db][?options]

- ``host:port`` pairs are the Sentinels (port 26379 unless given), tried in order.
- ``service`` is the name the Sentinels monitor (``sentinel monitor <service> ...``).
- ``user`` and ``password`` authenticate to the primary, as in a ``redis://`` URL.
- ``db`` is the database number (0 unless given), also as ``?db=N``.
- ``sentinel_password`` and ``sentinel_username`` (query options, percent-encoded)
  authenticate to the Sentinels themselves, which keep their own ``requirepass``.

The clients are redis-py's: :mod:`fence._async.sentinel` builds them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from urllib.parse import parse_qs, unquote, urlsplit

from fence._errors import ConfigurationError

__all__ = ["DEFAULT_SENTINEL_PORT", "SentinelURL", "is_sentinel_url", "parse_sentinel_url"]

#: The port a Sentinel listens on unless the URL names another.
DEFAULT_SENTINEL_PORT = 26379

_OPTIONS = ("db", "sentinel_password", "sentinel_username")
_FORM = "redis+sentinel://[[user]:password@]host[:port][,host2[:port2]...]/service[/db]"


@dataclass(frozen=True)
class SentinelURL:
    """What a ``redis+sentinel://`` URL says.

    Attributes:
        sentinels: the Sentinels' ``(host, port)`` pairs, in the URL's order.
        service: the monitored primary's name.
        db: the database number.
        username: the ACL user of the primary, if any.
        password: the primary's password, if any (never shown by ``str``).
        sentinel_username: the ACL user of the Sentinels, if any.
        sentinel_password: the Sentinels' password, if any (never shown by ``str``).
    """

    sentinels: tuple[tuple[str, int], ...]
    service: str
    db: int = 0
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    sentinel_username: str | None = None
    sentinel_password: str | None = field(default=None, repr=False)

    def __str__(self) -> str:
        where = ",".join(f"{host}:{port}" for host, port in self.sentinels)
        return f"sentinel {where} {self.service}/{self.db}"


def is_sentinel_url(url: object) -> bool:
    """Whether ``url`` is a string with a ``redis+sentinel://`` (or TLS) scheme."""
    if not isinstance(url, str):
        return False
    scheme = url.partition("://")[0].lower()
    return scheme in ("redis+sentinel", "rediss+sentinel")


def _port(text: str, url: str) -> int:
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 0 < port < 65536:
        raise ConfigurationError(f"not a usable Sentinel URL: bad port {text!r} in {url!r}")
    return port


def _hosts(netloc: str, url: str) -> tuple[tuple[str, int], ...]:
    found = []
    for item in netloc.split(","):
        item = item.strip()
        if not item:
            raise ConfigurationError(f"not a usable Sentinel URL: an empty host in {url!r}")
        if item.startswith("["):  # [IPv6]:port
            host, _, rest = item[1:].partition("]")
            port = _port(rest[1:], url) if rest.startswith(":") else DEFAULT_SENTINEL_PORT
        elif item.count(":") == 1:
            host, _, text = item.partition(":")
            port = _port(text, url)
        else:
            host, port = item, DEFAULT_SENTINEL_PORT
        if not host:
            raise ConfigurationError(f"not a usable Sentinel URL: an empty host in {url!r}")
        found.append((host, port))
    return tuple(found)


def parse_sentinel_url(url: str) -> SentinelURL:
    """Read a ``redis+sentinel://`` URL (see the module's docstring for the form).

    Raises:
        ConfigurationError: not a Sentinel URL; ``rediss+sentinel://`` (TLS: build the
            client with redis-py's ``Sentinel`` and pass ``master_for(...)``); no Sentinel,
            no service name, a bad port or database number, or an unknown option.

    Example::

        >>> str(parse_sentinel_url("redis+sentinel://:pw@s1,s2:26380/mymaster/2"))
        'sentinel s1:26379,s2:26380 mymaster/2'
    """
    scheme, sep, rest = url.partition("://")
    scheme = scheme.lower()
    if scheme == "rediss+sentinel":
        raise ConfigurationError(
            "rediss+sentinel:// (TLS) is not built from a URL: create redis-py's "
            "Sentinel(..., ssl=True, sentinel_kwargs={...}) and pass "
            "sentinel.master_for(service) as the client"
        )
    if scheme != "redis+sentinel" or not sep:
        raise ConfigurationError(f"not a redis+sentinel:// URL: {url!r}")
    # urlsplit reads one host:port; the Sentinels are a comma-separated list of them.
    netloc, _, tail = rest.partition("/")
    path, _, query = tail.partition("?")
    if "?" in netloc:
        netloc, _, query = netloc.partition("?")
    userinfo, at, hosts = netloc.rpartition("@")
    if not at:
        userinfo, hosts = "", netloc
    if not hosts:
        raise ConfigurationError(f"a Sentinel URL names its Sentinels: {_FORM} (got {url!r})")
    sentinels = _hosts(hosts, url)
    credentials = urlsplit(f"redis://{userinfo}@h") if userinfo else None
    username = unquote(credentials.username) if credentials and credentials.username else None
    password = (
        unquote(credentials.password)
        if credentials is not None and credentials.password is not None
        else None
    )
    parts = [unquote(p) for p in path.split("/")] if path else []
    if not parts or not parts[0]:
        raise ConfigurationError(
            f"a Sentinel URL names the monitored service: {_FORM} (got {url!r})"
        )
    if len(parts) > 2:
        raise ConfigurationError(f"not a usable Sentinel URL: {_FORM} (got {url!r})")
    options = parse_qs(query, keep_blank_values=True, strict_parsing=False)
    unknown = sorted(set(options) - set(_OPTIONS))
    if unknown:
        raise ConfigurationError(
            f"unknown option(s) {', '.join(unknown)} in a Sentinel URL; it takes "
            f"{', '.join(_OPTIONS)} (the manager's and guard's own settings are keyword "
            "arguments)"
        )
    db_text = options["db"][-1] if "db" in options else (parts[1:] or ["0"])[0] or "0"
    try:
        db = int(db_text)
    except ValueError:
        db = -1
    if db < 0:
        raise ConfigurationError(f"not a usable Sentinel URL: bad database {db_text!r}")

    def option(name: str) -> str | None:
        return options[name][-1] if name in options else None

    return SentinelURL(
        sentinels=sentinels,
        service=parts[0],
        db=db,
        username=username,
        password=password,
        sentinel_username=option("sentinel_username"),
        sentinel_password=option("sentinel_password"),
    )
