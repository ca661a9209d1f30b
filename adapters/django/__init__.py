"""Fencing for the Django ORM (Django 5.2 and later): a Django app.

Add ``"fence.adapters.django"`` to ``INSTALLED_APPS``, give a model a
:class:`FenceField` (and a :class:`TombstoneField`, or derive it from
:class:`fence.adapters.django.models.FencedModel`), install the database's judge with the
migration operation :class:`fence.adapters.django.operations.InstallFence`, and write it
inside :func:`fenced`::

    from fence.adapters.django import fenced

    with manager.lock("account:42") as lease, fenced(lease):
        account = Account.objects.get(pk=42)
        account.balance += 5
        account.save()               # refused with StaleTokenError if a newer holder wrote

Outside a block a write of a fenced model raises :class:`fence.TokenRequiredError` before
any I/O; :func:`unfenced` is the explicit opt-out. Django's async ORM runs inside
:func:`afenced` (``async with``). PostgreSQL, SQLite and MariaDB. See ``docs/django.md``.
"""

from __future__ import annotations

from .blocks import afenced, aunfenced, fenced, unfenced
from .fields import FencedQuerySet, FenceField, TombstoneField, judged_of

__all__ = [
    "FenceField",
    "FencedQuerySet",
    "TombstoneField",
    "afenced",
    "aunfenced",
    "fenced",
    "judged_of",
    "unfenced",
]

for _cls in (FenceField, FencedQuerySet, TombstoneField, afenced, aunfenced, fenced, unfenced):
    _cls.__module__ = __name__
del _cls
