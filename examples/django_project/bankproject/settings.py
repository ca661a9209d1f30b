"""Settings of the example project: SQLite in a file next to it, or PostgreSQL when
``DATABASE_URL`` names one (``postgresql://user:password@host:port/name``)."""

from __future__ import annotations

import os
from pathlib import Path
from urllib.parse import unquote, urlsplit

BASE_DIR = Path(__file__).resolve().parent.parent
SECRET_KEY = "example-only"  # noqa: S105 - an example's, never a real one
INSTALLED_APPS = ["fence.adapters.django", "bank"]
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
USE_TZ = True


def _database(url: str | None) -> dict[str, object]:
    if not url:
        return {"ENGINE": "django.db.backends.sqlite3", "NAME": BASE_DIR / "bank.sqlite3"}
    parts = urlsplit(url)
    return {
        "ENGINE": "django.db.backends.postgresql",
        "HOST": parts.hostname or "",
        "PORT": str(parts.port or ""),
        "USER": unquote(parts.username or ""),
        "PASSWORD": unquote(parts.password or ""),
        "NAME": parts.path.lstrip("/"),
        # The test database: one per process, so that two runs on one server never meet.
        "TEST": {"NAME": f"test_bank_{os.getpid()}"},
    }


DATABASES = {"default": _database(os.environ.get("DATABASE_URL"))}
