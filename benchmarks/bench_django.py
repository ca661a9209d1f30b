#!/usr/bin/env python3
"""A fenced Django ``save()`` vs a plain ``save()`` and vs optimistic version checks.

    python benchmarks/bench_django.py [--quick] [--repeats 7]

Each operation changes one field of a loaded instance and saves it, one save per
transaction, on SQLite (a file in WAL mode, ``synchronous=NORMAL``: no fsync at each
commit) and on the suite's PostgreSQL, interleaved in batches of
20 so that every variant sees the same machine:

- ``plain save(), atomic()``: ``with transaction.atomic(): row.save()``, the baseline (the
  same transaction as the fenced one: BEGIN, UPDATE, COMMIT);
- ``plain save(), autocommit``: ``row.save()`` alone (one statement, no BEGIN nor COMMIT);
- ``fenced save()``: ``with fenced(lease): row.save()``, the documented defaults: the
  lease's resource is claimed in the app's register at the first statement (on PostgreSQL
  in the same query text as the token's ``set_config``), the triggers judge the UPDATE;
  ``claim=False`` shows it without the claim;
- ``django-concurrency save()``: a model with django-concurrency's ``IntegerVersionField``
  (``UPDATE ... WHERE id AND version``) in ``atomic()``;
- ``hand-written version check``: ``filter(pk=..., version=v).update(version=v + 1, ...)``
  in ``atomic()``.

The lease comes from the in-memory manager (its check costs no I/O). Ratio = saves per
second / the baseline's.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import _harness
from _harness import Context, Row

GROUP = "django"
BASELINE = "plain save(), atomic()"
TARGETS = {"fenced save()": 0.95}
DATABASES = {"default": "SQLite", "pg": "PostgreSQL"}


def _configure(where: Path, pg_port: int) -> None:
    import django
    from django.conf import settings

    if settings.configured:
        return
    settings.configure(
        INSTALLED_APPS=["fence.adapters.django"],
        DATABASES={
            "default": {
                "ENGINE": "django.db.backends.sqlite3",
                "NAME": str(where / "bench.sqlite3"),
                # WAL, no fsync at each commit: the saves, not the disk, are measured
                "OPTIONS": {"init_command": "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL"},
            },
            "pg": {
                "ENGINE": "django.db.backends.postgresql",
                "HOST": "127.0.0.1",
                "PORT": str(pg_port),
                "USER": "postgres",
                "NAME": "postgres",
            },
        },
        DEFAULT_AUTO_FIELD="django.db.models.BigAutoField",
        USE_TZ=True,
    )
    django.setup()


def _models() -> dict[str, Any]:
    from django.db import models

    from fence.adapters.django import FenceField

    class Meta:
        app_label = "iofence_bench"

    def make(name: str, **fields: Any) -> Any:
        attrs = {"__module__": __name__, "Meta": Meta, "balance": models.IntegerField(default=0)}
        return type(name, (models.Model,), {**attrs, **fields})

    out = {
        "plain": make("BenchPlain"),
        "fenced": make("BenchFenced", fence=FenceField()),
        "hand": make("BenchHand", version=models.IntegerField(default=0)),
    }
    try:
        from concurrency.fields import IntegerVersionField

        out["concurrency"] = make("BenchConcurrency", version=IntegerVersionField())
    except ImportError:  # the bench group installs it; without it that row is left out
        pass
    return out


def _variants(alias: str, found: dict[str, Any], lease: Any) -> dict[str, Callable[[], None]]:
    from django.core.management import call_command
    from django.db import connections, transaction

    from fence.adapters.django import fenced, unfenced
    from fence.adapters.django.operations import install_fence

    call_command("migrate", "iofence", database=alias, verbosity=0)
    with connections[alias].schema_editor() as editor:
        for model in found.values():
            editor.create_model(model)
        install_fence(editor, found["fenced"])
    rows = {}
    for key, model in found.items():
        with unfenced(using=alias):
            rows[key] = model.objects.using(alias).create(balance=0)

    def plain_atomic() -> None:
        row = rows["plain"]
        row.balance += 1
        with transaction.atomic(using=alias):
            row.save(using=alias)

    def plain_autocommit() -> None:
        row = rows["plain"]
        row.balance += 1
        row.save(using=alias)

    def fenced_save() -> None:
        row = rows["fenced"]
        row.balance += 1
        with fenced(lease, using=alias):
            row.save(using=alias)

    def fenced_unclaimed() -> None:
        row = rows["fenced"]
        row.balance += 1
        with fenced(lease, using=alias, claim=False):
            row.save(using=alias)

    def hand() -> None:
        row = rows["hand"]
        with transaction.atomic(using=alias):
            done = (
                found["hand"]
                .objects.using(alias)
                .filter(pk=row.pk, version=row.version)
                .update(version=row.version + 1, balance=row.balance + 1)
            )
        if done != 1:
            raise RuntimeError("the hand-written version check lost its row")
        row.version += 1
        row.balance += 1

    variants = {
        BASELINE: plain_atomic,
        "plain save(), autocommit": plain_autocommit,
        "fenced save()": fenced_save,
        "fenced save(), claim=False": fenced_unclaimed,
        "hand-written version check": hand,
    }
    if "concurrency" in rows:

        def concurrency() -> None:
            row = rows["concurrency"]
            row.balance += 1
            with transaction.atomic(using=alias):
                row.save(using=alias)

        variants["django-concurrency save()"] = concurrency
    return variants


def collect(ctx: Context) -> list[Row]:
    """Saves per second of each variant, per database; see the module docstring."""
    from django.db import connections

    from fence import MemoryLockManager

    with tempfile.TemporaryDirectory(prefix="iofence-bench-django-") as where:
        _configure(Path(where), ctx.servers.postgres.port)
        found = _models()
        manager = MemoryLockManager(ttl=3600)
        rows: list[Row] = []
        try:
            lease = manager.acquire("bench:django")
            for alias, label in DATABASES.items():
                variants = _variants(alias, found, lease)
                with _harness.timer(ctx, f"Django saves on {label}"):
                    rates = _harness.interleaved(
                        variants, calls=ctx.n(1_000, 40), repeats=ctx.repeats, batch=20, warmup=20
                    )
                got = _harness.rate_rows(
                    GROUP,
                    rates,
                    BASELINE,
                    unit="saves/s",
                    prefix=f"Django {label}: ",
                    targets=TARGETS,
                )
                for row in got:
                    extra = 1e6 / row.value - 1e6 / row.baseline_value
                    row.note = f"{extra:+,.0f} us per save vs the baseline"
                rows += got
                if "django-concurrency save()" in variants:
                    versus = _harness.rate_rows(
                        GROUP,
                        rates,
                        "django-concurrency save()",
                        ["fenced save()"],
                        unit="saves/s",
                        prefix=f"Django {label}: ",
                        targets={"fenced save()": 1.0},
                    )
                    rows += versus
        finally:
            manager.close()
            for conn in connections.all(initialized_only=True):
                conn.close()
    return rows


if __name__ == "__main__":
    raise SystemExit(_harness.standalone(collect, __doc__))
