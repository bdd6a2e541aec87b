"""The command class every pulsectl command is registered with."""

from __future__ import annotations

from typing import Any

import typer.core

from pulsectl.errors import UsageError


class Command(typer.core.TyperCommand):
    """A command whose usage errors about an option (``UsageError(..., option="--as")``),
    found after parsing by the command or the library it calls, learn the command's path, so
    that the error boundary ends their line with the same hint as the parser's errors."""

    def invoke(self, ctx: Any) -> Any:  # click's Context: typer vendors click privately
        try:
            return super().invoke(ctx)
        except UsageError as exc:
            if exc.option is not None and exc.help_command is None:
                exc.help_command = help_command(ctx)
            raise


def help_command(ctx: typer.Context) -> str | None:
    """``pulsectl diff -h``: how to get the help of ``ctx``'s command (None: it has none)."""
    if ctx.command.get_help_option(ctx) is None:
        return None
    return f"{ctx.command_path} {ctx.help_option_names[0]}"
