"""``manage.py fence_revoke RESOURCE``: end a lock's lease by force (``fence revoke``), and
raise the resource's fence in the app's register to the new token."""

from __future__ import annotations

from typing import Any

from django.db import connections

from ..._state import claim_sql
from ...blocks import fenced
from ._run import FenceCommand


class Command(FenceCommand):
    """End every lease on RESOURCE, print a token above every token issued for it, and
    claim RESOURCE with that token in the fence register of ``--database`` (C8): from then
    on the database refuses the revoked holder's blocks at their first statement, not only
    the lock manager its calls."""

    help = (
        "end a lock's lease by force, print the new token (fence revoke) and raise the "
        "resource's fence in the database's fence register"
    )
    command = "revoke"

    def add_arguments(self, parser: Any) -> None:
        """RESOURCE."""
        super().add_arguments(parser)
        parser.add_argument("resource")

    def handle(self, *args: Any, **options: Any) -> None:
        """Run it.

        Raises:
            CommandError: ``fence revoke`` failed; the register is left as it was.
            StaleTokenError: the register holds a fence above the new token (a lock backend
                other than the one that issued it).
        """
        resource = options["resource"]
        token = int(self.run(options, resource).split()[-1])
        alias = options["database"]
        with fenced(token, using=alias), connections[alias].cursor() as cursor:
            cursor.execute(claim_sql(resource, token, connections[alias].vendor))
