"""The ``gputopo`` command line: a thin typer app.

Each command lives in its own module here (so each stays short and commands can grow side by side);
a command parses its options, calls one service, and hands the result to a renderer. Errors become a
message, a hint and an exit code in one place (``common.guarded``).
"""

from __future__ import annotations

import typer

from gputopo import __version__

app = typer.Typer(
    name="gputopo",
    help="GPU topology diagnostics and tuning: how your GPUs are wired, which to use, and what is broken.",
    no_args_is_help=True,
    add_completion=False,
    rich_markup_mode=None,
    pretty_exceptions_enable=False,
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


# Registering a command is importing its module.
from gputopo.cli import doctor, probe, recommend, stale, topo  # noqa: E402, F401


def main() -> None:
    """Console-script entry point."""
    app()
