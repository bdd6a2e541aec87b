"""The console script: a tiny module, so that an interrupt while the CLI loads exits like one
that arrives later (one line, exit 130) instead of a traceback."""

from __future__ import annotations

import signal
import sys


def _on_sigterm(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def run() -> None:
    signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        from pulsectl.cli.app import main
    except KeyboardInterrupt:
        sys.stderr.write("pulsectl: error: interrupted; no output was written\n")
        sys.exit(130)
    sys.exit(main())
