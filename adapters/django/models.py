"""The models of the iofence app: the abstract fenced model with a tombstone (C4, C7), and
the fence register that the blocks claim the leases' resources in (C8).

Django imports this module when the app registry loads its models (a model class needs
the registry); the fields and query sets live in :mod:`fence.adapters.django.fields`.
"""

from __future__ import annotations

from typing import Any

from django.db import models, router

from .fields import FencedQuerySet, FenceField, TombstoneField

__all__ = ["FenceRegister", "FencedModel"]


class FencedModel(models.Model):  # type: ignore[misc]
    """An abstract model with a fence (``fence``), a tombstone flag (``deleted``) and a
    manager of :class:`FencedQuerySet`: its ``delete()`` leaves a tombstone.

    Attributes:
        fence: the row's fence.
        deleted: the tombstone flag.
    """

    fence = FenceField()
    deleted = TombstoneField()

    objects = FencedQuerySet.as_manager()

    class Meta:
        abstract = True

    def delete(self, using: str | None = None, keep_parents: bool = False) -> tuple[int, Any]:
        """Leave a tombstone: set ``deleted`` on the row (an ``UPDATE``, judged as one).

        Args:
            using: the database alias (default: the router's).
            keep_parents: unused; a tombstone keeps everything.
        """
        alias = using or router.db_for_write(type(self), instance=self)
        count = type(self)._base_manager.using(alias).filter(pk=self.pk).update(deleted=True)
        if count:
            setattr(self, "deleted", True)  # noqa: B010 - the instance's value, not the field
        return count, {self._meta.label: count}

    delete.alters_data = True  # type: ignore[attr-defined]


class FenceRegister(models.Model):  # type: ignore[misc]
    """The fence of each resource a block claimed (C8): one row per resource, never
    deleted (a register's rows are its tombstones). Judged like a fenced table.

    Attributes:
        scope: the lease's resource.
        fence: the highest token that claimed it.
    """

    scope = models.CharField(max_length=512, primary_key=True)
    fence = models.BigIntegerField()

    class Meta:
        app_label = "iofence"
        db_table = "iofence_fence_register"
