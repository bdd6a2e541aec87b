"""The typer app: registers the commands and owns the one error boundary (``main``)."""

from __future__ import annotations

import errno
import os
import re
import signal
import sys
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Annotated

import typer

from pulsectl import __version__, _placed
from pulsectl._env import switch
from pulsectl.cli import apply as apply_cmd
from pulsectl.cli import cast as cast_cmd
from pulsectl.cli import demo as demo_cmd
from pulsectl.cli import diff as diff_cmd
from pulsectl.cli import hash as hash_cmd
from pulsectl.cli import inspect as inspect_cmd
from pulsectl.cli import loco as loco_cmd
from pulsectl.cli import log as log_cmd
from pulsectl.cli import prune as prune_cmd
from pulsectl.cli import publish as publish_cmd
from pulsectl.cli import pull as pull_cmd
from pulsectl.cli import squash as squash_cmd
from pulsectl.cli import stats as stats_cmd
from pulsectl.cli import verify as verify_cmd
from pulsectl.cli._command import Command, help_command
from pulsectl.cli._output import GuardedStdout, Output
from pulsectl.errors import (
    EXIT_ERROR,
    EXIT_USAGE,
    PulseError,
    ReaderGoneError,
    UsageError,
    escape_controls,
)

EXIT_INTERRUPTED = 130

app = typer.Typer(
    name="pulsectl",
    help=(
        "Lossless, compact diffs of safetensors checkpoints.\n\n"
        "Exit codes: 0 ok, 1 error, 2 usage, 3 integrity (wrong base, damaged patch, "
        "fingerprint mismatch), 130 interrupted, 141 the reader of text output went away "
        "(| head; no message, as git)."
    ),
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _version(value: bool) -> None:
    if value:
        from pulsectl.codecs import _fast

        print(f"pulsectl {__version__} (codec loops: {_fast.describe()})")
        raise typer.Exit()


@app.callback()
def _global(
    ctx: typer.Context,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="Only errors on stderr.")] = False,
    verbose: Annotated[
        bool, typer.Option("--verbose", "-v", help="Tracebacks on errors (or PULSECTL_DEBUG=1).")
    ] = False,
    version: Annotated[
        bool,
        typer.Option(
            "--version",
            callback=_version,
            is_eager=True,
            help="Print the version and the codec loops in use.",
        ),
    ] = False,
) -> None:
    ctx.obj = Output(quiet=quiet, verbose=verbose)
    # A library's warnings (torch's, numpy's) as one line each, silenced by -q; main restores
    # Python's own display when the command ends.
    warnings.showwarning = ctx.obj.warning


app.command("diff", cls=Command)(diff_cmd.diff)
app.command("apply", cls=Command)(apply_cmd.apply)
app.command("hash", cls=Command)(hash_cmd.hash_)
app.command("verify", cls=Command)(verify_cmd.verify)
app.command("inspect", cls=Command)(inspect_cmd.inspect)
app.command("squash", cls=Command)(squash_cmd.squash)
app.command("demo", cls=Command)(demo_cmd.demo)
app.command("cast", cls=Command)(cast_cmd.cast)
app.command("stats", cls=Command)(stats_cmd.stats)
app.command("publish", cls=Command)(publish_cmd.publish)
app.command("pull", cls=Command)(pull_cmd.pull)
app.command("log", cls=Command)(log_cmd.log)
app.command("prune", cls=Command)(prune_cmd.prune)
app.add_typer(loco_cmd.app, name="loco")


def _wants_traceback(argv: list[str]) -> bool:
    return bool(switch("PULSECTL_DEBUG")) or any(a in ("-v", "--verbose") for a in argv)


def _on_sigterm(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _end_like_ctrl_c() -> None:
    """SIGTERM, and SIGHUP (a closed terminal or tmux pane) unless ignored (nohup), end the
    run as Ctrl-C does: temps removed, one line, exit 130."""
    signal.signal(signal.SIGTERM, _on_sigterm)
    if hasattr(signal, "SIGHUP") and signal.getsignal(signal.SIGHUP) is not signal.SIG_IGN:
        signal.signal(signal.SIGHUP, _on_sigterm)


_GLOBAL_FLAGS = ("-q", "--quiet", "-v", "--verbose")


def _hoist_global_flags(args: list[str]) -> list[str]:
    """Accept -q/-v after the command too (`pulsectl diff a b -q`), as users type them."""
    if "--" in args:
        cut = args.index("--")
        head, tail = args[:cut], args[cut:]
    else:
        head, tail = args, []
    flags = [a for a in head if a in _GLOBAL_FLAGS]
    return flags + [a for a in head if a not in _GLOBAL_FLAGS] + tail


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; every failure becomes one ``pulsectl: error: ...`` line and an exit code."""
    args = _hoist_global_flags(list(sys.argv[1:] if argv is None else argv))
    _end_like_ctrl_c()
    real_stdout = sys.stdout
    sys.stdout = GuardedStdout(real_stdout)  # a failed write to stdout is one line
    try:
        with _placed.recording() as written, warnings.catch_warnings():
            return _main(args, written)
    finally:
        sys.stdout = real_stdout


def _main(args: list[str], written: list[Path]) -> int:
    code = 0
    try:
        if "" in args:
            # Path("") is the current folder: `pulsectl hash "$CKPT"` with CKPT unset would
            # read the whole folder as a checkpoint. No argument of pulsectl is empty.
            raise UsageError(
                f"argument {args.index('') + 1} is empty (an unset shell variable?); give a "
                "path or a value"
            )
        _check_environment()
        result = app(args=args, prog_name="pulsectl", standalone_mode=False)
        code = result if isinstance(result, int) else 0
        if code == EXIT_INTERRUPTED:  # typer turns KeyboardInterrupt into a silent Exit(130)
            sys.stderr.write(f"pulsectl: error: {_interrupted_line(written)}\n")
    except ReaderGoneError as exc:  # `| head` took what it wanted: no message, as git
        code = exc.exit_code
    except PulseError as exc:
        if _wants_traceback(args):
            traceback.print_exc()
        hint = exc.help_command if isinstance(exc, UsageError) else None
        sys.stderr.write(f"pulsectl: error: {_with_hint(exc.message, hint)}\n")
        code = exc.exit_code
    except typer.Exit as exc:
        code = exc.exit_code
    except typer.TyperException as exc:  # usage errors from the parser: one line too
        # `pulsectl` or `pulsectl loco` alone: the help. Told apart by name, as typer does:
        # its click is vendored under a private module.
        show = getattr(exc, "show", None)
        if type(exc).__name__ == "NoArgsIsHelpError" and show is not None:
            show()
        else:
            sys.stderr.write(f"pulsectl: error: {_parser_error(exc)}\n")
        code = getattr(exc, "exit_code", None) or EXIT_USAGE
    except (KeyboardInterrupt, typer.Abort):
        sys.stderr.write(f"pulsectl: error: {_interrupted_line(written)}\n")
        code = EXIT_INTERRUPTED
    except MemoryError:
        sys.stderr.write("pulsectl: error: out of memory\n")
        code = EXIT_ERROR
    except Exception as exc:
        if isinstance(exc, OSError) and exc.errno == errno.ENAMETOOLONG:
            # A path the system refuses to look up (pathlib's is_dir() or exists() raise it).
            name = escape_controls(os.fsdecode(exc.filename or "a path"))
            sys.stderr.write(f"pulsectl: error: {name}: {exc.strerror}; give a shorter path\n")
            code = EXIT_ERROR
        elif _no_thread(exc):
            # A worker thread that cannot start: its stack did not fit (a `ulimit -v`).
            sys.stderr.write(
                "pulsectl: error: out of memory: cannot start a worker thread (a memory limit "
                "such as ulimit -v?); give fewer workers (-j) or more memory\n"
            )
            code = EXIT_ERROR
        elif _interrupted(exc):
            # Ctrl-C inside an import: numpy, say, turns it into an ImportError of its own.
            sys.stderr.write(f"pulsectl: error: {_interrupted_line(written)}\n")
            code = EXIT_INTERRUPTED
        else:
            traceback.print_exc()
            sys.stderr.write(
                "pulsectl: error: internal error (a bug in pulsectl); please report it with the "
                "traceback above\n"
            )
            code = EXIT_ERROR
    try:
        sys.stdout.flush()  # what is left in the buffer (click's --help)
    except PulseError as exc:  # one line for the first error only
        if code == 0 and isinstance(exc, ReaderGoneError):
            code = exc.exit_code
        elif code == 0:
            if _wants_traceback(args):
                traceback.print_exc()
            sys.stderr.write(f"pulsectl: error: {exc.message}\n")
            code = exc.exit_code
    return code


def _interrupted_line(written: list[Path]) -> str:
    """What an interrupt left: the outputs this run had put in place and that are still there
    (a signal can come right after the last rename; demo's are in a temp folder, removed by
    then), else nothing, or a patch on stdout, whole or in part, or text on stdout (lines a
    command printed before the interrupt, the rest missing)."""
    events = _placed.events()
    if events:
        return escape_controls(f"interrupted {events[-1]}")
    there = list(dict.fromkeys(str(p) for p in written if os.path.lexists(p)))
    if there:
        shown = ", ".join(there[:3]) + (f" and {len(there) - 3} more" if len(there) > 3 else "")
        verb = "was" if len(there) == 1 else "were"
        return escape_controls(f"interrupted after {shown} {verb} written")
    stdout = sys.stdout
    if isinstance(stdout, GuardedStdout):
        if stdout.sent is not None and stdout.sent_whole:
            return f"interrupted after {stdout.sent} was written to standard output"
        if stdout.sent is not None:
            return f"interrupted; {stdout.sent} on standard output is incomplete"
        if stdout.texted:
            return "interrupted; no file was written, and standard output may be incomplete"
    return "interrupted; no output was written"


def _check_environment() -> None:
    """Refuse a PULSECTL_* setting with a value it does not take (`PULSECTL_PREHASH=no`),
    which would otherwise be taken silently for one it does."""
    from pulsectl._env import bad_setting

    bad = bad_setting()
    if bad is not None:
        name, value, what = bad
        raise UsageError(f"environment variable {name}={value!r}: {what}")


def _parser_error(exc: typer.TyperException) -> str:
    """A usage error from the parser (a bad option value, a missing argument, an unknown
    option or command) as one line, ending in click's hint to run --help."""
    format_message = getattr(exc, "format_message", None)
    text = format_message() if format_message is not None else str(exc)
    text = escape_controls(" ".join(text.split())).removesuffix(".")
    if text[1:2].islower():  # "Invalid value ..." reads as the rest of pulsectl's lines
        text = text[:1].lower() + text[1:]
    # click's suggestion, "No such command 'difff'. Did you mean 'diff'?", as one clause.
    text = re.sub(r"\. Did you mean (.*)\?$", r" (did you mean \1?)", text)
    text = text.replace("(Possible options:", "(possible options:")
    ctx = getattr(exc, "ctx", None)
    return _with_hint(text, (help_command(ctx) if ctx is not None else None) or "pulsectl -h")


def _with_hint(message: str, command: str | None) -> str:
    """A usage error's line, ending in the hint to run ``command`` (where there is one)."""
    return message if command is None else f"{message}; try '{command}' for help"


def _no_thread(exc: BaseException) -> bool:
    """Whether ``exc`` (or what caused it) is CPython's "can't start new thread"."""
    return _in_chain(
        exc, lambda e: isinstance(e, RuntimeError) and "can't start new thread" in str(e)
    )


def _interrupted(exc: BaseException) -> bool:
    """Whether ``exc`` was raised while a KeyboardInterrupt was being handled (or from one)."""
    return _in_chain(exc, lambda e: isinstance(e, KeyboardInterrupt))


def _in_chain(exc: BaseException, match: Callable[[BaseException], bool]) -> bool:
    """Whether ``exc``, or an exception it was raised from or while handling, matches."""
    seen: set[int] = set()
    at: BaseException | None = exc
    while at is not None and id(at) not in seen:
        if match(at):
            return True
        seen.add(id(at))
        at = at.__cause__ or at.__context__
    return False


def run() -> None:
    sys.exit(main())


if __name__ == "__main__":
    run()
