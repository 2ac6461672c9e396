"""Every ``dlcp``, ``dlcpctl`` and ``make`` command in README.md and docs/ runs as written: each
one in a fenced shell block is parsed by the program's own parser (so option names, choices and
value ranges are checked, as at the prompt, without running anything), and every ``make``
target exists in the Makefile. A renamed flag or a narrowed range then fails here, not for a
reader."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
PROGRAMS = ("dlcp", "dlcpctl")
#: What may stand before a command on a line: privileges, niceness, a one-off environment.
PREFIX = re.compile(r"^(?:sudo\s+(?:-E\s+)?|nice\s+-n\s+\d+\s+|[A-Z_][A-Z0-9_]*=\S*\s+)+")


SHELL_FENCES = ("sh", "bash", "shell", "console")


def _blocks(text: str) -> list[str]:
    """The commands of fenced shell blocks: a ```sh, ```bash or ```shell block's every line, a
    ```console block's lines after a ``$`` prompt (the rest is output). Fences are paired in
    order, so a block's closing fence never opens the next."""
    blocks: list[str] = []
    lang: str | None = None
    body: list[str] = []
    for line in text.splitlines():
        fence = re.match(r"^\s*```(\S*)", line)
        if fence is None:
            if lang is not None:
                body.append(line)
        elif lang is None:
            lang, body = fence.group(1), []
        else:
            if lang == "console":
                body = [b for b in body if b.startswith("$ ")]
            if lang in SHELL_FENCES:
                blocks.append("\n".join(body) + "\n")
            lang = None
    return blocks


def _commands(block: str) -> list[str]:
    """One string per command: continuation lines joined, comments, prompts and prefixes gone,
    ``a && b`` and ``a; b`` split."""
    joined = re.sub(r"\\\n\s*", " ", block)
    out = []
    for line in joined.splitlines():
        line = line.strip()
        if line.startswith("$ "):
            line = line[2:]
        line = re.sub(r"(^|\s)#.*$", "", line).strip()
        for part in re.split(r"\s*(?:&&|;)\s*", line):
            part = PREFIX.sub("", part.strip())
            if part:
                out.append(part)
    return out


def _program(words: list[str]) -> tuple[str, list[str]] | None:
    """(program, arguments) of a ``dlcp``/``dlcpctl``/``make`` command, else None."""
    head = words[0].rsplit("/", 1)[-1]
    if head in (*PROGRAMS, "make"):
        return head, words[1:]
    if len(words) > 2 and head.startswith("python") and words[1] == "-m" and words[2] in PROGRAMS:
        return words[2], words[3:]
    return None


def documented() -> list[tuple[str, str, list[str]]]:
    """(where, program, arguments) of every documented command of ours."""
    found = []
    for doc in DOCS:
        for block in _blocks(doc.read_text()):
            for cmd in _commands(block):
                try:
                    words = shlex.split(cmd)
                except ValueError:
                    continue  # not a shell command (output in a shell block)
                prog = _program(words) if words else None
                if prog is not None:
                    found.append((f"{doc.relative_to(ROOT)}: {cmd}", *prog))
    return found


def _make_targets() -> set[str]:
    return set(re.findall(r"^([A-Za-z][\w-]*):", (ROOT / "Makefile").read_text(), re.M))


def _parser(program: str):
    if program == "dlcp":
        from dlcp.cli import build_parser
    else:
        from dlcp.controller.cli import build_parser
    return build_parser()


COMMANDS = documented()


def test_the_docs_hold_commands_of_every_program():
    """The extraction itself works: the README's quick start and the main tools are found."""
    programs = {p for _, p, _ in COMMANDS}
    assert programs == {"dlcp", "dlcpctl", "make"}, programs
    assert any(p == "make" and a == ["test"] for w, p, a in COMMANDS if w.startswith("README.md"))
    assert len(COMMANDS) > 30


@pytest.mark.parametrize("where, program, args", COMMANDS, ids=[w[:90] for w, _, _ in COMMANDS])
def test_a_documented_command_parses_as_written(where, program, args, capsys):
    if program == "make":
        missing = [a for a in args if not a.startswith("-") and "=" not in a and a not in _make_targets()]
        assert not missing, f"{where}: no make target {missing}"
        return
    try:
        _parser(program).parse_args(args)
    except SystemExit as exc:  # --help and --version exit 0; an error exits 2
        assert exc.code == 0, f"{where}\n{capsys.readouterr().err.strip()}"
