"""The bank's one model: an account whose rows only a lease's holder writes."""

from __future__ import annotations

from django.db import models

from fence.adapters.django.models import FencedModel


class Account(FencedModel):
    """An account: a balance, and from ``FencedModel`` a fence and a tombstone flag."""

    owner = models.CharField(max_length=40)
    balance = models.IntegerField(default=0)
