"""The error type the simulator raises for bad user input (preset, option, bundle content)."""


class SimInputError(ValueError):
    """One line naming the file/field/value and what was expected; the CLI prints it and exits 2."""
