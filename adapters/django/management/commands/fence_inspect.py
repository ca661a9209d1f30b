"""``manage.py fence_inspect RESOURCE``: who holds a lock (``fence inspect``)."""

from __future__ import annotations

from typing import Any

from ._run import FenceCommand


class Command(FenceCommand):
    """Show who holds RESOURCE: holder, token, time left, and the fence where one is kept."""

    help = "who holds a lock: holder, token, time left (fence inspect)"
    command = "inspect"

    def add_arguments(self, parser: Any) -> None:
        """RESOURCE and ``--json``."""
        super().add_arguments(parser)
        parser.add_argument("resource")
        parser.add_argument("--json", action="store_true", help="print one JSON object")

    def handle(self, *args: Any, **options: Any) -> None:
        """Run it."""
        self.run(options, options["resource"], *(["--json"] if options["json"] else []))
