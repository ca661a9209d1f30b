"""``python -m fence``: the same as the ``fence`` command."""

from fence.cli import main

raise SystemExit(main())
