"""The models of the Django integration's tests."""

from __future__ import annotations

from django.db import models

from fence.adapters.django import FencedQuerySet, FenceField
from fence.adapters.django.models import FencedModel


class Account(FencedModel):
    """Fenced, with a tombstone flag (``deleted``): a delete leaves the row."""

    name = models.CharField(max_length=40, unique=True)
    balance = models.IntegerField(default=0)


class Note(models.Model):
    """Fenced, without a tombstone flag: a delete removes the row."""

    text = models.CharField(max_length=40)
    fence = FenceField()

    objects = FencedQuerySet.as_manager()


class Plain(models.Model):
    """Not fenced: written anywhere, as Django always did."""

    text = models.CharField(max_length=40)
