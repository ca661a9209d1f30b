"""``manage.py fence_revoke RESOURCE``: end a lock's lease by force (``fence revoke``)."""

from __future__ import annotations

from typing import Any

from ._run import FenceCommand


class Command(FenceCommand):
    """End every lease on RESOURCE and print a token above every token issued for it."""

    help = "end a lock's lease by force and print the new token (fence revoke)"
    command = "revoke"

    def add_arguments(self, parser: Any) -> None:
        """RESOURCE."""
        super().add_arguments(parser)
        parser.add_argument("resource")

    def handle(self, *args: Any, **options: Any) -> None:
        """Run it."""
        self.run(options, options["resource"])
