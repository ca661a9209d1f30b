"""Alembic operations that install, upgrade and remove the database's judge (C14).

Importing this module (in ``env.py`` or in a migration) registers two operations on
Alembic's ``op``::

    from alembic import op
    import fence.adapters.alembic  # noqa: F401 - registers op.install_fence_triggers


    def upgrade() -> None:
        op.install_fence_triggers("accounts", tombstone="deleted")
        op.install_fence_triggers("fence_register", register=True)


    def downgrade() -> None:
        op.drop_fence_triggers("fence_register")
        op.drop_fence_triggers("accounts")

Each runs the statements of :func:`fence.adapters.ddl.trigger_ddl` (or
:func:`~fence.adapters.ddl.drop_trigger_ddl`) for the migration's dialect, online or in
``--sql`` mode. Installing again replaces the triggers with this version's: an upgrade of
the judge is a migration that installs them again.
"""

from __future__ import annotations

from typing import Any

from alembic.operations import MigrateOperation, Operations

from .ddl import DEFAULT_FENCE_COLUMN, drop_trigger_ddl, trigger_ddl

__all__ = ["DropFenceTriggersOp", "InstallFenceTriggersOp"]

#: The judge's DDL passes the client-side gate as the guards' own statements do: it
#: writes nothing, but its text names the tables it guards.
_OWN = {"iofence": True}


@Operations.register_operation("install_fence_triggers")
class InstallFenceTriggersOp(MigrateOperation):
    """Install (or upgrade) the database's judge of a table: ``op.install_fence_triggers``.

    Args:
        table: the table's name.
        schema: its schema.
        fence: its fence column.
        tombstone: its tombstone flag, if it has one (a hard delete is then refused).
        register: the table is a fence register.
        optional: a ``fenced_version()`` model's table (writes without a token pass).
    """

    def __init__(
        self,
        table: str,
        *,
        schema: str | None = None,
        fence: str = DEFAULT_FENCE_COLUMN,
        tombstone: str | None = None,
        register: bool = False,
        optional: bool = False,
    ) -> None:
        self.table = table
        self.schema = schema
        self.fence = fence
        self.tombstone = tombstone
        self.register = register
        self.optional = optional

    @classmethod
    def install_fence_triggers(cls, operations: Operations, table: str, **kw: Any) -> Any:
        """Install (or upgrade) the database's judge of ``table`` (see the class)."""
        return operations.invoke(cls(table, **kw))

    def reverse(self) -> DropFenceTriggersOp:
        """The operation that undoes this one (autogenerate's downgrade)."""
        return DropFenceTriggersOp(self.table, schema=self.schema, fence=self.fence)


@Operations.register_operation("drop_fence_triggers")
class DropFenceTriggersOp(MigrateOperation):
    """Remove the database's judge of a table: ``op.drop_fence_triggers``. The guards then
    refuse to write the table until it is installed again.

    Args:
        table: the table's name.
        schema: its schema.
        fence: its fence column.
    """

    def __init__(
        self, table: str, *, schema: str | None = None, fence: str = DEFAULT_FENCE_COLUMN
    ) -> None:
        self.table = table
        self.schema = schema
        self.fence = fence

    @classmethod
    def drop_fence_triggers(cls, operations: Operations, table: str, **kw: Any) -> Any:
        """Remove the database's judge of ``table`` (see the class)."""
        return operations.invoke(cls(table, **kw))

    def reverse(self) -> InstallFenceTriggersOp:
        """The operation that undoes this one."""
        return InstallFenceTriggersOp(self.table, schema=self.schema, fence=self.fence)


@Operations.implementation_for(InstallFenceTriggersOp)
def _install(operations: Operations, operation: InstallFenceTriggersOp) -> None:
    dialect = operations.migration_context.dialect.name
    for statement in trigger_ddl(
        operation.table,
        dialect=dialect,
        schema=operation.schema,
        fence=operation.fence,
        tombstone=operation.tombstone,
        register=operation.register,
        optional=operation.optional,
    ):
        operations.execute(statement, execution_options=_OWN)


@Operations.implementation_for(DropFenceTriggersOp)
def _drop(operations: Operations, operation: DropFenceTriggersOp) -> None:
    dialect = operations.migration_context.dialect.name
    for statement in drop_trigger_ddl(
        operation.table, dialect=dialect, schema=operation.schema, fence=operation.fence
    ):
        operations.execute(statement, execution_options=_OWN)
