"""The ``gputopo`` command line: a thin typer app.

Each command lives in its own module here (so each stays short and commands can grow side by side);
a command parses its options, calls one service, and hands the result to a renderer. Errors become a
message, a hint and an exit code in one place (``common.guarded``).
"""

from __future__ import annotations

import sys
from pathlib import Path

import typer

from gputopo import __version__

app = typer.Typer(
    name="gputopo",
    help="GPU topology diagnostics and tuning: how your GPUs are wired, which to use, and what is broken.",
    no_args_is_help=True,
    add_completion=False,
    rich_markup_mode=None,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
    epilog="Start with `gputopo doctor`; `gputopo COMMAND -h` shows each command's options and examples.",
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"gputopo {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(
        False, "--version", callback=_version, is_eager=True, help="Print the version and exit."
    ),
) -> None:
    """GPU topology diagnostics and tuning."""


# Registering a command is importing its module. Typer builds the parser of every registered command on
# each run (about 10 ms for all of them, a quarter of topo's start-up budget), so when gputopo runs as a
# program with a command named on its command line, only that command's module is loaded. Imported any
# other way (tests, `import gputopo.cli`), every command is there.
COMMAND_MODULES = {
    "accept": "accept",
    "check": "check",
    "doctor": "doctor",
    "hang": "hang",
    "report": "doctor",
    "probe": "probe",
    "recommend": "recommend",
    "run": "run",
    "kill-stale": "stale",
    "slow": "slow",
    "nodes": "nodes",
    "topo": "topo",
}


def load_commands(names: list[str] | None = None) -> None:
    """Register the commands ``names`` (all when ``None``) by importing their modules."""
    import importlib

    wanted = COMMAND_MODULES if names is None else {n: COMMAND_MODULES[n] for n in names}
    for module in dict.fromkeys(wanted.values()):
        importlib.import_module(f"gputopo.cli.{module}")


def _invoked_command() -> str | None:
    """The command named on the command line when this process is the gputopo program, else ``None``."""
    if len(sys.argv) < 2:
        return None
    prog = Path(sys.argv[0])
    is_gputopo = prog.name == "gputopo" or (prog.name == "__main__.py" and prog.parent.name == "gputopo")
    return sys.argv[1] if is_gputopo and sys.argv[1] in COMMAND_MODULES else None


_command = _invoked_command()
load_commands([_command] if _command else None)


def main() -> None:
    """Console-script entry point: option errors become one line and a hint, like every other error."""
    sys.exit(run_main())


def run_main(args: list[str] | None = None) -> int:
    """Run the app on ``args`` (default: ``sys.argv[1:]``) and return the exit code.

    typer's own usage error takes four lines (usage, "Try ... for help", a blank, the error); here it is
    the same one line and hint as any other bad input (``common.guarded``).
    """
    from gputopo.cli.common import report_usage_error

    try:
        code = app(args=args, prog_name="gputopo", standalone_mode=False)
    except typer.Abort:
        sys.stderr.write("aborted\n")
        return 1
    except typer.TyperException as exc:  # typer's usage errors (unknown option, bad value, missing)
        return report_usage_error(exc)
    return code if isinstance(code, int) else 0
