"""`ciera`: one console script; each stage package registers its own subcommands here.

User mistakes (a bad bundle, an unknown preset, a malformed option) surface as the package's own
error type; they print as one line on stderr and exit with code 2, never as a traceback.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any

import typer
import typer.core
import typer.main

# (module, attribute) pairs: each module has `register(app)` and `USER_ERRORS`, a tuple of exception types.
STAGE_CLI_MODULES = (
    "traces.cli",
    "measure.cli",
    "sim.cli",
    "sim.analytic_cli",
    "validation.cli",
    "report.cli",
)

app = typer.Typer(
    name="ciera",
    help="CIERA: lossless exponent-reuse Allgather for sharded MoE training, and its scale-out simulator.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)


def _version(value: bool) -> None:
    if value:
        from importlib.metadata import PackageNotFoundError, version

        try:
            print(f"ciera {version('ciera')}")
        except PackageNotFoundError:  # run from a source tree that was never installed
            print("ciera (not installed: no version metadata)")
        raise typer.Exit()


# Typer 0.29 prints the type of every flag in help as `<bool>` (its own --help and --version included), yet a
# flag takes no value: help shows no type for flags, in every command.
_display_type_rich = typer.core.TyperOption.display_type_rich


def _no_type_for_flags(self: typer.core.TyperOption, ctx: Any) -> str | None:
    return None if self.is_flag else _display_type_rich(self, ctx)


typer.core.TyperOption.display_type_rich = _no_type_for_flags  # type: ignore[method-assign]


@app.callback()
def _root(
    show_version: bool = typer.Option(
        False, "--version", callback=_version, is_eager=True, help="Print the version and exit."
    ),
) -> None:
    """CIERA: lossless exponent-reuse Allgather for sharded MoE training, and its scale-out simulator.

    Start with `ciera models` and `ciera clusters` (what can be simulated), `ciera simulate`, `ciera report`.
    """


_user_errors: list[type[BaseException]] = []
for _module_name in STAGE_CLI_MODULES:
    _module = importlib.import_module(_module_name)
    _module.register(app)
    _user_errors.extend(_module.USER_ERRORS)
USER_ERRORS: tuple[type[BaseException], ...] = tuple(_user_errors)


# click's UsageError (a malformed option), which Typer raises from its own copy of click in recent versions
# and from click in older ones: found as the base of typer.BadParameter either way.
_USAGE_ERROR: type[Exception] = next(c for c in typer.BadParameter.__mro__ if c.__name__ == "UsageError")


def _command_of(argv: list[str]) -> tuple[Any, list[str], int]:
    """The click command `argv` invokes, its path (`ciera validate sim`) and where its own tokens start."""
    command: Any = typer.main.get_command(app)
    path, position = ["ciera"], 0
    while hasattr(command, "commands") and position < len(argv) and argv[position] in command.commands:
        command = command.commands[argv[position]]
        path.append(argv[position])
        position += 1
    return command, path, position


def option_taken_as_value(argv: list[str]) -> str | None:
    """The one-line error for an option given where another option's value belongs (`ciera simulate
    --sweep --gpus 7`: click takes `--gpus` as the sweep's value and then refuses `7` as an extra
    argument, naming neither option); None when there is none. Only a token that is one of the command's
    own option names (its --help included: `--json --help` would write a file named `--help`) counts, so a
    negative number or a path that starts with a dash stays a value."""
    if not any(a.startswith("--") and b.startswith("--") for a, b in zip(argv, argv[1:], strict=False)):
        return None  # no two options side by side: nothing to look up (the command tree takes ~30 ms)
    command, path, position = _command_of(argv)
    options = [param for param in getattr(command, "params", []) if param.param_type_name == "option"]
    names = {name for option in options for name in (*option.opts, *option.secondary_opts)}
    if hasattr(command, "get_help_option_names"):
        names.update(command.get_help_option_names(command.context_class(command)))
    takes_value = {
        name for option in options if not option.is_flag and not option.count for name in option.opts
    }
    tokens = argv[position:]
    for token, following in zip(tokens, tokens[1:], strict=False):
        if token == "--":
            break
        if token in takes_value and following in names:
            return (
                f"error: {token} expects a value, got the option {following} (see `{' '.join(path)} --help`)"
            )
    return None


def main() -> None:
    misplaced = option_taken_as_value(sys.argv[1:])
    if misplaced is not None:
        print(misplaced, file=sys.stderr)
        sys.exit(2)
    try:
        # Not standalone: click raises a malformed option (`--layers two`, an unknown option, a missing
        # value) as a UsageError, which prints as one line like every other user error, not a usage box.
        code = app(standalone_mode=False)
    except USER_ERRORS as error:
        message = " ".join(str(error).split())
        print(f"error: {message}", file=sys.stderr)
        sys.exit(2)
    except _USAGE_ERROR as error:
        # The command the arguments name: click's context for a missing value is the root's.
        command = " ".join(_command_of(sys.argv[1:])[1])
        message = " ".join(error.format_message().split())
        print(f"error: {message} (see `{command} --help`)", file=sys.stderr)
        sys.exit(2)
    except typer.Abort:  # Ctrl-C, or EOF at a prompt
        print("aborted", file=sys.stderr)
        sys.exit(130)
    sys.exit(code if isinstance(code, int) else 0)


if __name__ == "__main__":
    main()
