"""From ``version_id_col`` to a fence with one line, and the race only the fence refuses.

Migration of an existing table (PostgreSQL; on SQLite only the RENAME is needed):

    ALTER TABLE example_dropin_docs RENAME COLUMN version TO fence;
    ALTER TABLE example_dropin_docs ALTER COLUMN fence TYPE BIGINT;

    python examples/occ_dropin.py
    DATABASE_URL=postgresql+psycopg://... python examples/occ_dropin.py
"""

from __future__ import annotations

import os
import tempfile

from sqlalchemy import BigInteger, create_engine
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

from fence.adapters.orm import StaleTokenError, bind, fenced_version


class Base(DeclarativeBase):
    pass


class Doc(Base):
    __tablename__ = "example_dropin_docs"
    id: Mapped[int] = mapped_column(primary_key=True, autoincrement=False)
    text: Mapped[str]
    fence: Mapped[int] = mapped_column(BigInteger)  # was: version: Mapped[int]
    __mapper_args__ = fenced_version(fence)  # was: {"version_id_col": version}


def main(url: str) -> int:
    """Show both modes; return 0 if the stale re-read write was refused."""
    engine = create_engine(url)
    Base.metadata.drop_all(engine)
    Base.metadata.create_all(engine)
    with Session(engine) as s:  # no lease bound: plain optimistic concurrency
        s.add(Doc(id=1, text="draft"))
        s.commit()
        s.get_one(Doc, 1).text = "edited"
        s.commit()
        print(f"without a lease the version counts up: {s.get_one(Doc, 1).fence}")

    with Session(engine) as a, Session(engine) as b:
        bind(a, token=10, claim=False)  # the holder whose lease ran out
        bind(b, token=11, claim=False)  # the holder after it
        stale = a.get_one(Doc, 1)
        b.get_one(Doc, 1).text = "by B"
        b.commit()
        a.refresh(stale)  # A re-reads: an equality check on the version would now pass
        stale.text = "by A"
        try:
            a.commit()
        except StaleTokenError as err:
            print(f"A re-read fence {err.fence}; its token {err.token} is refused")
            a.rollback()
        else:
            return 1
    with Session(engine) as s:
        doc = s.get_one(Doc, 1)
        print(f"text {doc.text!r}, fence {doc.fence}")
        ok = (doc.text, doc.fence) == ("by B", 11)
    engine.dispose()
    return 0 if ok else 1


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as tmp:  # SQLite by default; or DATABASE_URL
        raise SystemExit(main(os.environ.get("DATABASE_URL", f"sqlite:///{tmp}/docs.db")))
