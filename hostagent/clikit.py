"""Command-line plumbing shared by ``dlcp`` and ``dlcpctl``: exceptions become exit codes.

Library code never prints or exits; a command's function returns its exit code. Here a
:class:`~dlcp.hostagent.errors.DlcpUserError` prints one line on stderr (exit 2 for usage, 1
otherwise); anything else prints one line and the log path, with the traceback under ``--debug``.
Both programs also share how options are checked as they are parsed (:func:`number`,
:func:`numbers`), how ``--help`` shows defaults, global flags after the sub-command, and
``--version``.
"""

from __future__ import annotations

import argparse
import io
import logging
import os
import select
import signal
import sys
import tempfile
from pathlib import Path
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from dlcp.hostagent.errors import DlcpUserError, UsageError
from dlcp.hostagent.ranges import Range

#: A global option: its flags and ``add_argument`` keywords (given before or after the sub-command).
GlobalOption = tuple[tuple[str, ...], dict[str, Any]]


def number(rng: Range, kind: type = int) -> Callable[[str], Any]:
    """An argparse ``type=`` reading one ``kind`` in ``rng``, so a bad value fails at parse time
    (argparse then prints "argument --opt: VALUE is outside LO..HI" and exits 2)."""
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {_a(kind)}") from None
        why = rng.problem(value)
        if why is not None:
            raise argparse.ArgumentTypeError(why)
        return value

    parse.__name__ = kind.__name__
    return parse


def numbers(rng: Range, kind: type = float) -> Callable[[str], tuple]:
    """An argparse ``type=`` for comma-separated values (``0,0.1,0.2``), each checked as :func:`number`."""
    one = number(rng, kind)

    def parse(text: str) -> tuple:
        parts = [p.strip() for p in text.split(",") if p.strip()]
        if not parts:
            raise argparse.ArgumentTypeError(f"{text!r} holds no value (comma-separated numbers expected)")
        return tuple(one(p) for p in parts)

    parse.__name__ = f"list of {kind.__name__}"
    return parse


def _showable(default: object) -> bool:
    """Whether help should name this default: not for a missing one or a flag's off (0 is shown)."""
    return default is not None and default is not False and default is not argparse.SUPPRESS


def _a(kind: type) -> str:
    return {int: "an integer", float: "a number"}.get(kind, f"a {kind.__name__}")


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """Appends "(default: X)" to an option's help so ``--help`` shows the values actually used;
    left out where the help already explains the default or there is none to show."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if not action.option_strings or not _showable(action.default) or "default" in text.lower():
            return action.help
        shown = ",".join(map(str, action.default)) if isinstance(action.default, (tuple, list)) else "%(default)s"
        return f"{text} (default: {shown})".lstrip()


def package_version() -> str:
    """The installed ``dlcp`` distribution's version, or pyproject.toml's in a source tree that is not installed."""
    from importlib import metadata

    try:
        return metadata.version("dlcp")
    except metadata.PackageNotFoundError:
        pass
    if sys.version_info >= (3, 11):  # tomllib is 3.11's
        import tomllib

        try:
            with open(Path(__file__).resolve().parents[1] / "pyproject.toml", "rb") as f:
                return f"{tomllib.load(f)['project']['version']} (source tree, not installed)"
        except (OSError, KeyError, ValueError):
            pass
    return "unknown (not installed)"


def _subparsers(parser: argparse.ArgumentParser) -> Iterator[argparse.ArgumentParser]:
    """Every sub-command's parser below ``parser``, at any depth (``dlcp policy show``)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in dict.fromkeys(action.choices.values()):  # aliases share a parser
                yield sub
                yield from _subparsers(sub)


def finish_parser(parser: argparse.ArgumentParser, global_options: Sequence[GlobalOption]) -> argparse.ArgumentParser:
    """Give a program's parser tree what both programs share: ``--version``, defaults in every
    ``--help``, and the global options accepted after the sub-command as well as before it.

    Call it once the sub-commands are added. A global option repeated on a sub-command has no
    default there, so one given before the sub-command is not overwritten.
    """
    parser.add_argument("--version", action="version", version=f"%(prog)s {package_version()}")
    for flags, kwargs in global_options:
        parser.add_argument(*flags, **kwargs)
    for sub in _subparsers(parser):
        for flags, kwargs in global_options:
            if not any(f in sub._option_string_actions for f in flags):
                sub.add_argument(*flags, **_after_command(kwargs))
    for p in (parser, *_subparsers(parser)):
        _show_defaults(p)
    return parser


def _after_command(kwargs: dict[str, Any]) -> dict[str, Any]:
    """A global option's keywords for a sub-command: no default there (it would overwrite the
    value given before the sub-command), the top level's default named in its help instead."""
    default = kwargs.get("default")
    text = kwargs.get("help") or ""
    if _showable(default) and kwargs.get("action") not in ("store_true", "store_false"):
        text = f"{text} (default: {default})".lstrip()
    return {**kwargs, "help": text, "default": argparse.SUPPRESS}


def _show_defaults(parser: argparse.ArgumentParser) -> None:
    """Make ``parser``'s help show every option's default, also where the option has no help text
    (argparse formats no help line at all for those)."""
    parser.formatter_class = DefaultsHelpFormatter
    for action in parser._actions:
        if not action.help and action.option_strings and _showable(action.default):
            action.help = "(default: %(default)s)"


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the program is, so its ``finally`` blocks tear down what it started
    (switches, namespaces, agents) as on Ctrl-C."""


def _terminate(signum: int, frame: object) -> None:
    raise Terminated()


def run_cli(parser: argparse.ArgumentParser, argv: Sequence[str] | None, name: str) -> int:
    """Parse, dispatch and turn exceptions into exit codes; shared by ``dlcp`` and ``dlcpctl``.

    SIGTERM stops a command as Ctrl-C does (exit 143), and so does SIGINT when the shell
    started the command in the background with SIGINT ignored (``nohup ... &``): a run stopped
    either way removes its network, where before it was left for ``dlcp clean``."""
    handlers = {signal.SIGTERM: signal.signal(signal.SIGTERM, _terminate)}
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        handlers[signal.SIGINT] = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        return _dispatch(parser, argv, name)
    finally:
        for sig, old in handlers.items():
            signal.signal(sig, old)


def _dispatch(parser: argparse.ArgumentParser, argv: Sequence[str] | None, name: str) -> int:
    args = parser.parse_args(argv)
    debug = getattr(args, "debug", False)
    logging.basicConfig(level=logging.DEBUG if debug else logging.WARNING,
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
    except KeyboardInterrupt as exc:
        print(f"{name}: {'terminated' if isinstance(exc, Terminated) else 'interrupted'}", file=sys.stderr)
        return 143 if isinstance(exc, Terminated) else 130
    except BrokenPipeError as exc:
        if _reader_left():  # ``dlcp report ... | head``: stop quietly, as Unix tools do
            return 141
        if debug:
            raise
        return _unexpected(name, exc)
    except Exception as exc:  # a bug: one line for the user, the traceback in the log
        if debug:
            raise
        return _unexpected(name, exc)


def _reader_left() -> bool:
    """Whether standard output is the pipe that broke (its reader is gone); if so, point it at
    /dev/null, so exiting does not try to flush into it again. A broken pipe to a subprocess or a
    socket is not this: it is an error like any other."""
    try:
        fd = sys.stdout.fileno()
    except (OSError, ValueError, io.UnsupportedOperation):  # a stdout without a descriptor
        return False
    poll = select.poll()
    poll.register(fd, select.POLLOUT)
    if not any(events & select.POLLERR for _, events in poll.poll(0)):  # a pipe with no reader: POLLERR
        return False
    os.dup2(os.open(os.devnull, os.O_WRONLY), fd)
    return True


def _unexpected(name: str, exc: BaseException) -> int:
    """A bug: one line for the user, the traceback in the log."""
    log_path = _log_traceback(name)
    print(f"{name}: unexpected error: {exc!r} (traceback in {log_path}; rerun with --debug)", file=sys.stderr)
    return 1


def _log_traceback(name: str) -> Path:
    """Write the exception being handled to a log file only, so the terminal keeps its one line."""
    log_path = Path(tempfile.gettempdir()) / f"{name}-error.log"
    logger = logging.getLogger(f"{name}.crash")
    logger.propagate = False  # not through the root logger's stderr handler
    handler = logging.FileHandler(log_path)
    handler.setFormatter(logging.Formatter("%(asctime)s %(message)s"))
    logger.addHandler(handler)
    try:
        logger.exception("unexpected error")
    finally:
        logger.removeHandler(handler)
        handler.close()
    return log_path
