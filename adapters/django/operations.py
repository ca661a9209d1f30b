"""Migration operations of the iofence app: the database's judge of a fenced model (C14).

``makemigrations`` writes the fence column (a :class:`~fence.adapters.django.FenceField`)
as any other field; the triggers that judge the writes come from :class:`InstallFence`,
added to the migration by hand after the operation that creates the column::

    from django.db import migrations
    from fence.adapters.django.operations import InstallFence

    class Migration(migrations.Migration):
        dependencies = [("shop", "0002_account_fence")]
        operations = [InstallFence("account")]

Until it has run, writes of the model are refused: the triggers are checked before the
first write on each connection.
"""

from __future__ import annotations

import contextlib
from typing import Any

from django.db import transaction
from django.db.migrations.operations.base import Operation

from fence._errors import ConfigurationError

from .._triggers import (
    Judged,
    mariadb_drop_ddl,
    mariadb_judge_ddl,
    pg_drop_ddl,
    pg_judge_ddl,
    sqlite_drop_ddl,
    sqlite_judge_ddl,
)
from ._state import is_mariadb, state_of
from .fields import judged_of

__all__ = ["InstallFence", "install_fence"]


def _ddl(connection: Any, judged: Judged, *, drop: bool) -> list[str]:
    vendor = connection.vendor
    if vendor == "postgresql":
        return pg_drop_ddl(judged) if drop else pg_judge_ddl(judged)
    if vendor == "sqlite":
        return sqlite_drop_ddl(judged) if drop else sqlite_judge_ddl(judged)
    if is_mariadb(connection):
        # CREATE OR REPLACE TRIGGER: the table is never without its judge.
        return mariadb_drop_ddl(judged) if drop else mariadb_judge_ddl(judged)
    raise ConfigurationError(
        f"iofence has no database judge on {connection.display_name} yet (C14): the "
        f"triggers of {judged.table} cannot be installed"
    )


def _run(schema_editor: Any, statements: list[str], judged: Judged) -> None:
    conn = schema_editor.connection
    # The triggers of a table go in together where DDL is transactional (PostgreSQL,
    # SQLite); MariaDB commits each DDL statement and refuses DDL inside atomic(), and its
    # CREATE OR REPLACE TRIGGER leaves the table without a judge at no moment.
    atomic = conn.features.can_rollback_ddl and not schema_editor.collect_sql
    with transaction.atomic(using=conn.alias) if atomic else contextlib.nullcontext():
        for statement in statements:
            # No parameters: the text reaches the database as it is.
            schema_editor.execute(statement, params=None)
    state_of(conn).checked.discard(judged.check_key)


def install_fence(schema_editor: Any, model: type[Any], *, drop: bool = False) -> None:
    """Install (or with ``drop``, remove) the triggers of ``model`` through
    ``schema_editor``, outside a migration (a script, a test); a migration uses
    :class:`InstallFence`.

    Args:
        schema_editor: ``connection.schema_editor()``.
        model: a model with a :class:`~fence.adapters.django.FenceField`.
        drop: remove them instead.

    Raises:
        ConfigurationError: the model has no fence, or the database has no judge.
    """
    judged = judged_of(model)
    if judged is None:
        raise ConfigurationError(f"{model.__name__} has no FenceField: nothing to judge")
    _run(schema_editor, _ddl(schema_editor.connection, judged, drop=drop), judged)


class InstallFence(Operation):  # type: ignore[misc]
    """Install (forwards) or drop (backwards) the triggers that judge every write of a
    fenced model's rows, on PostgreSQL, SQLite and MariaDB. Running it again replaces them (an
    upgrade of the judge is a migration with this operation once more).

    Args:
        model_name: the model, in the migration's app (``"account"``), as the other
            model operations name it.

    Raises:
        ConfigurationError: (when run) the model has no
            :class:`~fence.adapters.django.FenceField`, or the database has no judge.
    """

    reversible = True
    reduces_to_sql = True
    # Not Django's atomic(): MariaDB refuses DDL in it. _run makes the triggers of a table
    # one transaction where the database can roll DDL back.
    atomic = False

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name

    def deconstruct(self) -> tuple[str, list[Any], dict[str, Any]]:
        """How a migration writes it: ``InstallFence("account")``."""
        return self.__class__.__name__, [self.model_name], {}

    def state_forwards(self, app_label: str, state: Any) -> None:
        """Nothing: triggers are not part of Django's model state."""

    def database_forwards(
        self, app_label: str, schema_editor: Any, from_state: Any, to_state: Any
    ) -> None:
        """Install the triggers of the model as ``to_state`` has it."""
        model = to_state.apps.get_model(app_label, self.model_name)
        if not self.allow_migrate_model(schema_editor.connection.alias, model):
            return
        install_fence(schema_editor, model)

    def database_backwards(
        self, app_label: str, schema_editor: Any, from_state: Any, to_state: Any
    ) -> None:
        """Drop the triggers (and on PostgreSQL their function)."""
        model = from_state.apps.get_model(app_label, self.model_name)
        if not self.allow_migrate_model(schema_editor.connection.alias, model):
            return
        install_fence(schema_editor, model, drop=True)

    def describe(self) -> str:
        """What ``sqlmigrate`` and ``migrate`` say about it."""
        return (
            f"Install the iofence judge (triggers that refuse unfenced and stale writes) "
            f"on {self.model_name}"
        )

    @property
    def migration_name_fragment(self) -> str:
        """The part of an automatic migration name it gives."""
        return f"install_fence_{self.model_name.lower()}"
