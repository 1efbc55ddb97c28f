"""Typer options that more than one command shares: recommend and run choose a set by the same rules
(``services.recommend.Choice``), declared here once and handed to the command as one ``Choice``
(``choice_options``)."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import typer

from gputopo.cli.common import INPUT_OPTION
from gputopo.services.recommend import DEFAULT_MAX_USED_MIB, Choice

F = TypeVar("F", bound=Callable[..., Any])


EXCLUDE_OPTION = typer.Option(
    None, "--exclude", metavar="LIST", help="GPUs to leave out, e.g. 3,4 (see docs/output.md: GPU lists)."
)


ALLOW_BUSY_OPTION = typer.Option(False, "--allow-busy", help="Count GPUs in use by other processes.")


MAX_USED_OPTION = typer.Option(
    DEFAULT_MAX_USED_MIB, "--max-used-mib", help="A GPU with more memory in use than this is busy."
)


ALLOW_UNHEALTHY_OPTION = typer.Option(
    False,
    "--allow-unhealthy",
    help="Count GPUs with a health problem (uncorrectable ECC, pending row remap, slowdown, ...) in.",
)


REPORT_OPTION = typer.Option(
    None,
    "--from-report",
    metavar="PATH",
    help="A probe or doctor report (JSON) from this machine: keep failing pairs apart, use measurements.",
)


FORCE_REPORT_OPTION = typer.Option(
    False,
    "--force-report",
    help="Use --from-report even when it was written on another machine or on CPU stand-ins.",
)


IGNORE_VISIBLE_OPTION = typer.Option(
    False,
    "--ignore-visible-devices",
    help="Choose among every GPU here, not only those a preset CUDA_VISIBLE_DEVICES (a scheduler's "
    "allocation) allows.",
)


# The options ``Choice`` is built from, in the order --help shows them: (name, type, typer option).
CHOICE_OPTIONS: tuple[tuple[str, Any, Any], ...] = (
    ("input", str | None, INPUT_OPTION),
    ("exclude", str | None, EXCLUDE_OPTION),
    ("allow_busy", bool, ALLOW_BUSY_OPTION),
    ("allow_unhealthy", bool, ALLOW_UNHEALTHY_OPTION),
    ("max_used_mib", int, MAX_USED_OPTION),
    ("from_report", Path | None, REPORT_OPTION),
    ("force_report", bool, FORCE_REPORT_OPTION),
)


def choice_options(command: F) -> F:
    """Give a typer command the set-choice options in place of its ``choice`` parameter: --help lists
    them there, and the command is called with them as one ``Choice`` (built, so checked, once)."""
    sig = inspect.signature(command)
    names = [name for name, _, _ in CHOICE_OPTIONS]
    shared = [
        inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=option, annotation=kind)
        for name, kind, option in CHOICE_OPTIONS
    ]
    params: list[inspect.Parameter] = []
    for p in sig.parameters.values():
        params.extend(shared if p.name == "choice" else [p])

    @functools.wraps(command)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        choice = Choice(**{name: kwargs.pop(name) for name in names})
        return command(*args, choice=choice, **kwargs)

    wrapper.__signature__ = sig.replace(parameters=params)  # type: ignore[attr-defined]
    hints = {k: v for k, v in command.__annotations__.items() if k != "choice"}
    wrapper.__annotations__ = {**hints, **{name: kind for name, kind, _ in CHOICE_OPTIONS}}
    return wrapper  # type: ignore[return-value]
