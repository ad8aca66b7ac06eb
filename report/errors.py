"""The error type the report raises for bad user input (a records or timeline file, an option)."""


class ReportInputError(ValueError):
    """One line naming the file, field and value and what was expected; the CLI prints it and exits 2."""
