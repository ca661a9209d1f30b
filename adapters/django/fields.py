"""The fields of a fenced Django model: its fence and its tombstone flag (C4, C7).

A model with a :class:`FenceField` is fenced: the database's judge (C14, installed by
:class:`~fence.adapters.django.operations.InstallFence`) refuses every write of its rows
that carries no token, or a token below the row's fence, and raises the fence to the token
of every write it accepts. A :class:`TombstoneField` makes the judge refuse a hard delete:
a fenced delete keeps the row and its fence (:class:`FencedQuerySet`), so a stale writer
cannot bring the row back.
"""

from __future__ import annotations

from typing import Any

from django.db import connections, models, router
from django.db.models.signals import class_prepared

from .._triggers import Judged
from ._state import FENCED_TABLES, REGISTER, bound_token

__all__ = [
    "FenceField",
    "FencedQuerySet",
    "TombstoneField",
    "fence_field_of",
    "judged_of",
    "tombstone_field_of",
]


class FenceField(models.BigIntegerField):  # type: ignore[misc]
    """The fence of a row: ``BIGINT NOT NULL DEFAULT 0``, written by the judge only.

    Rows start at 0, so the first token accepted raises them. It is not editable: the
    database sets it to the token of each write it accepts. A save inside
    :func:`~fence.adapters.django.fenced` writes the block's token into it (and into the
    instance), so that an instance read before a newer holder's write never asks the
    database to lower the fence.

    Args:
        kwargs: passed on to :class:`django.db.models.BigIntegerField`; ``default`` and
            ``editable`` are the field's own.
    """

    description = "Fencing token of the row's last accepted write (iofence)"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("default", 0)
        kwargs["editable"] = False
        super().__init__(*args, **kwargs)

    def deconstruct(self) -> tuple[str, str, list[Any], dict[str, Any]]:
        """What a migration writes: the public path, without the field's fixed options."""
        name, _, args, kwargs = super().deconstruct()
        kwargs.pop("editable", None)
        if kwargs.get("default") == 0:
            kwargs.pop("default")
        return name, "fence.adapters.django.FenceField", args, kwargs

    def pre_save(self, model_instance: models.Model, add: bool) -> Any:
        """The bound token of the block the save runs in, else the instance's value."""
        alias = model_instance._state.db or router.db_for_write(
            type(model_instance), instance=model_instance
        )
        token = bound_token(connections[alias])
        if token is None:
            token = bound_token(None)  # the only block open in this thread, on any alias
        if token is None:
            return super().pre_save(model_instance, add)
        setattr(model_instance, self.attname, token)
        return token


class TombstoneField(models.BooleanField):  # type: ignore[misc]
    """The tombstone flag of a fenced model: ``BOOLEAN NOT NULL DEFAULT FALSE`` (C7).

    With it the judge refuses a hard delete of the model's rows; :class:`FencedQuerySet`
    and :class:`FencedModel` delete by setting it, and the row keeps its fence.

    Args:
        kwargs: passed on to :class:`django.db.models.BooleanField`.
    """

    description = "Tombstone flag of a fenced row (iofence)"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("default", False)
        kwargs["editable"] = False
        super().__init__(*args, **kwargs)

    def deconstruct(self) -> tuple[str, str, list[Any], dict[str, Any]]:
        """What a migration writes: the public path, without the field's fixed options."""
        name, _, args, kwargs = super().deconstruct()
        kwargs.pop("editable", None)
        if kwargs.get("default") is False:
            kwargs.pop("default")
        return name, "fence.adapters.django.TombstoneField", args, kwargs


def fence_field_of(model: type[models.Model]) -> FenceField | None:
    """The :class:`FenceField` of ``model``, or ``None`` (the model is not fenced)."""
    for field in model._meta.concrete_fields:
        if isinstance(field, FenceField):
            return field
    return None


def tombstone_field_of(model: type[models.Model]) -> TombstoneField | None:
    """The :class:`TombstoneField` of ``model``, or ``None``."""
    for field in model._meta.concrete_fields:
        if isinstance(field, TombstoneField):
            return field
    return None


def judged_of(model: type[models.Model]) -> Judged | None:
    """The judge of ``model``'s table as its fields say, or ``None`` if it has no fence;
    the app's fence register is judged as one."""
    if model._meta.app_label == "iofence" and model._meta.model_name == "fenceregister":
        return REGISTER
    fence = fence_field_of(model)
    if fence is None:
        return None
    tombstone = tombstone_field_of(model)
    pk = model._meta.pk
    return Judged(
        model._meta.db_table,
        fence=fence.column,
        tombstone=tombstone.column if tombstone is not None else None,
        key=(pk.column,) if pk is not None else None,
    )


class FencedQuerySet(models.QuerySet):  # type: ignore[misc]
    """A query set whose :meth:`delete` leaves tombstones on a model with a
    :class:`TombstoneField` (C7); on other models it deletes as Django does."""

    def delete(self) -> tuple[int, dict[str, int]]:
        """Set the tombstone flag of the rows (one ``UPDATE``, judged like any write): the
        rows and their fences stay. Returns what Django's ``delete()`` returns."""
        tombstone = tombstone_field_of(self.model)
        if tombstone is None:
            result: tuple[int, dict[str, int]] = super().delete()
            return result
        count = self.filter(**{tombstone.name: False}).update(**{tombstone.name: True})
        return count, {self.model._meta.label: count}

    delete.alters_data = True  # type: ignore[attr-defined]
    delete.queryset_only = True  # type: ignore[attr-defined]

    def alive(self) -> FencedQuerySet:
        """The rows that are not tombstones (all rows of a model without the flag)."""
        tombstone = tombstone_field_of(self.model)
        if tombstone is None:
            return self
        found: FencedQuerySet = self.filter(**{tombstone.name: False})
        return found


def _prepared(sender: type[models.Model], **kwargs: Any) -> None:
    # Every model class with a fence, the ones declared after the app registry is ready
    # included: the execute wrapper refuses their unbound writes before any I/O.
    if sender._meta.abstract or sender._meta.proxy:
        return
    judged = judged_of(sender)
    if judged is not None:
        FENCED_TABLES[judged.table.lower()] = judged


class_prepared.connect(_prepared, dispatch_uid="iofence")
