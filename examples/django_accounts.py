"""Django: a holder that paused past its lease cannot save its stale write.

A reads an account inside ``fenced(lease)``, then pauses; its lease runs out. B takes the
lock and saves. A wakes: a new block on its lease is refused by the client (the lease is
over), and the write it would have sent with its old token is refused by the database's
triggers. A write outside any block is refused before it is sent.

    python examples/django_accounts.py
    DATABASE_URL=postgresql://user@host/db python examples/django_accounts.py

A one-file Django project: the app ``bank`` is made in this process; a real project keeps
the model in ``bank/models.py`` and installs the triggers with the migration operation
``InstallFence("account")``.
"""

from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile
import types
from urllib.parse import urlsplit

import django
from django.conf import settings
from django.core.management import call_command
from django.db import connection, models

from fence import (
    LeaseExpiredError,
    ManualClock,
    MemoryLockManager,
    StaleTokenError,
    TokenRequiredError,
)
from fence.adapters.django import fenced
from fence.adapters.django.operations import install_fence


def database(url: str | None, folder: str) -> dict[str, str]:
    """Django's settings of the database: PostgreSQL from a URL, else SQLite in a file."""
    if not url:
        return {"ENGINE": "django.db.backends.sqlite3", "NAME": f"{folder}/bank.sqlite3"}
    parts = urlsplit(url)
    return {
        "ENGINE": "django.db.backends.postgresql",
        "HOST": parts.hostname or "",
        "PORT": str(parts.port or ""),
        "USER": parts.username or "",
        "PASSWORD": parts.password or "",
        "NAME": parts.path.lstrip("/"),
    }


folder = tempfile.mkdtemp(prefix="iofence-example-")
atexit.register(shutil.rmtree, folder, ignore_errors=True)  # the SQLite file goes with the run
bank = types.ModuleType("bank")
bank.__file__ = f"{folder}/bank.py"  # an app needs a folder
sys.modules["bank"] = bank
settings.configure(
    INSTALLED_APPS=["fence.adapters.django", "bank"],
    DATABASES={"default": database(os.environ.get("DATABASE_URL"), folder)},
    DEFAULT_AUTO_FIELD="django.db.models.BigAutoField",
)
django.setup()

from fence.adapters.django.models import FencedModel  # noqa: E402 - a model needs the apps


class Account(FencedModel):  # a fence column and a tombstone flag
    balance = models.IntegerField()

    class Meta:
        app_label = "bank"
        db_table = "example_django_account"


def main() -> int:
    """Run the story; return 0 if every stale or unbound write was refused."""
    call_command("migrate", "iofence", verbosity=0)  # the fence register the blocks claim in
    with connection.schema_editor() as editor:
        editor.execute("DROP TABLE IF EXISTS example_django_account", params=None)
        editor.create_model(Account)
        install_fence(editor, Account)  # a real project: InstallFence in a migration

    clock = ManualClock()
    manager = MemoryLockManager(clock=clock, ttl=10)
    lease_a = manager.acquire("account:1", owner="A")
    with fenced(lease_a):
        Account.objects.create(id=1, balance=100)
        account = Account.objects.get(pk=1)
    print(f"A (token {lease_a.token}) reads balance {account.balance}, then pauses")
    clock.advance(15)  # A's lease runs out while it is paused

    lease_b = manager.acquire("account:1", owner="B")
    with fenced(lease_b):
        current = Account.objects.get(pk=1)
        current.balance += 50
        current.save()
    print(f"B (token {lease_b.token}) adds 50 and saves; fence {current.fence}")

    account.balance -= 30  # A wakes and writes what it computed from its old read
    refused = 0
    try:
        with fenced(lease_a):
            account.save()
    except LeaseExpiredError:
        print("A's new block is refused: its lease is over")
        refused += 1
    try:
        with fenced(lease_a.token):  # the token alone, as a worker that kept it would send
            account.save()
    except StaleTokenError as err:
        print(f"A's save is refused by the database: {err.reason}, token {err.token}")
        refused += 1
    try:
        account.save()
    except TokenRequiredError:
        print("a save outside any block is refused before it is sent")
        refused += 1

    final = Account.objects.get(pk=1)
    print(f"balance {final.balance}, fence {final.fence}")
    lease_b.release()
    manager.close()
    return 0 if refused == 3 and final.balance == 150 and final.fence == lease_b.token else 1


if __name__ == "__main__":
    sys.exit(main())
