"""The one error type a trace reader or writer raises for bad input."""


class TraceError(ValueError):
    """A bundle that does not match the trace schema. The message is one line naming file, table,
    column and value, so the CLI can print it as-is and exit 2."""
