"""``manage.py fence_doctor``: check the lock backend's settings (``fence doctor``)."""

from __future__ import annotations

from typing import Any

from ._run import FenceCommand


class Command(FenceCommand):
    """Judge the backend's settings for fencing: ok, warn or fail, with what to do."""

    help = "check the lock backend's settings for fencing (fence doctor)"
    command = "doctor"

    def add_arguments(self, parser: Any) -> None:
        """``--strict``."""
        super().add_arguments(parser)
        parser.add_argument("--strict", action="store_true", help="fail on a warning too")

    def handle(self, *args: Any, **options: Any) -> None:
        """Run it."""
        self.run(options, *(["--strict"] if options["strict"] else []))
