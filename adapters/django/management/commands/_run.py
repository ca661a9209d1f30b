"""What the three commands share: the ``fence`` command, on the project's lock backend."""

from __future__ import annotations

import contextlib
import io
from typing import Any

from django.core.management.base import BaseCommand, CommandError

from fence.cli import main

from ...locks import lock_url


class FenceCommand(BaseCommand):  # type: ignore[misc]
    """A ``fence`` subcommand run on :func:`~fence.adapters.django.locks.lock_url`."""

    command = ""

    def add_arguments(self, parser: Any) -> None:
        """The database alias; the subcommand adds its own."""
        parser.add_argument(
            "--database", default="default", help="the alias, without IOFENCE_LOCKS"
        )

    def run(self, options: dict[str, Any], *args: str) -> str:
        """Run ``fence COMMAND URL ARGS``; its output goes to the command's streams, and
        what it printed is returned.

        Raises:
            CommandError: the command failed (its exit status is not 0).
        """
        out, err = io.StringIO(), io.StringIO()
        url = lock_url(options["database"])
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            status = main([self.command, url, *args])
        self.stdout.write(out.getvalue(), ending="")
        self.stderr.write(err.getvalue(), ending="")
        if status != 0:
            raise CommandError(f"fence {self.command} exited {status}", returncode=status)
        return out.getvalue()
