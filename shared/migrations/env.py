"""Alembic environment: run by :func:`rlfleet.shared.engines.migrate` with a live connection."""

from alembic import context

from rlfleet.shared.schema import Base

connection = context.config.attributes["connection"]
context.configure(
    connection=connection,
    target_metadata=Base.metadata,
    render_as_batch=connection.dialect.name == "sqlite",  # SQLite needs table rebuilds for ALTER
)
with context.begin_transaction():
    context.run_migrations()
