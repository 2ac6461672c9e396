"""Command-line plumbing shared by ``dlcp`` and ``dlcpctl``: exceptions become exit codes.

Library code never prints or exits; a command's function returns its exit code. Here a
:class:`~hostagent.errors.DlcpUserError` prints one line on stderr (exit 2 for usage, 1
otherwise); anything else prints one line and the log path, with the traceback under ``--debug``.
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
from pathlib import Path
from typing import Callable, Sequence

from hostagent.errors import DlcpUserError, UsageError


def run_cli(parser: argparse.ArgumentParser, argv: Sequence[str] | None, name: str) -> int:
    """Parse, dispatch and turn exceptions into exit codes; shared by ``dlcp`` and ``dlcpctl``."""
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.debug else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    func: Callable[[argparse.Namespace], int] | None = getattr(args, "func", None)
    if func is None:
        parser.print_help(sys.stderr)
        return UsageError.exit_code
    try:
        return func(args)
    except DlcpUserError as exc:
        print(f"{name}: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print(f"{name}: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # a bug: one line for the user, the traceback in the log
        if args.debug:
            raise
        log_path = Path(tempfile.gettempdir()) / f"{name}-error.log"
        logging.getLogger(name).addHandler(logging.FileHandler(log_path))
        logging.getLogger(name).exception("unexpected error")
        print(f"{name}: unexpected error: {exc!r} (traceback in {log_path}; rerun with --debug)", file=sys.stderr)
        return 1
