"""The docs and the code cannot drift apart: every option of every command is documented
in README.md or docs/*.md, shows in its --help, and every environment variable the docs
name is one a command reads (and says so in its --help); docs/architecture.md lists every
module, each under its package, the protocol and its tooling in the order they import."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import click
import pytest
from click.testing import CliRunner
from helpers.imports import import_graph

from batchgate.cli import main

ROOT = Path(__file__).resolve().parent.parent
DOCS = "\n".join(p.read_text() for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob(
    "*.md"))])
# Read by the test suite, not by a command (docs/guarantees.md describes them).
TEST_ONLY_ENV = {"BATCHGATE_FULL", "BATCHGATE_FUZZ_EXAMPLES", "BATCHGATE_CHROMIUM",
                 "BATCHGATE_SCREENSHOT"}


def commands() -> Iterator[tuple[list[str], click.Command]]:
    """(argv path, command) of every command and group, lazy ones included."""
    def walk(path: list[str], command: click.Command,
             ctx: click.Context) -> Iterator[tuple[list[str], click.Command]]:
        yield path, command
        if isinstance(command, click.Group):
            for name in command.list_commands(ctx):
                sub = command.get_command(ctx, name)
                assert sub is not None, name
                yield from walk([*path, name], sub, ctx)
    with click.Context(main) as ctx:
        yield from walk([], main, ctx)


COMMANDS = list(commands())


def documented(word: str) -> bool:
    return re.search(r"(?<![\w-])" + re.escape(word) + r"(?![\w-])", DOCS) is not None


def help_text(path: list[str]) -> str:
    result = CliRunner().invoke(main, [*path, "--help"], terminal_width=200)
    assert result.exit_code == 0, result.output
    return result.output


@pytest.mark.parametrize(("path", "command"), COMMANDS,
                         ids=[" ".join(["batchgate", *p]) for p, _ in COMMANDS])
def test_every_option_is_documented_and_in_help(path: list[str],
                                                command: click.Command) -> None:
    shown = help_text(path)
    assert command.help, f"batchgate {' '.join(path)} has no description"
    for param in command.params:
        if not isinstance(param, click.Option):
            continue
        names = [o for o in param.opts + param.secondary_opts if o.startswith("--")]
        assert not param.hidden, f"{names} is hidden from --help"
        for name in names:
            assert documented(name), f"batchgate {' '.join(path)} {name} is not in the docs"
            assert name in shown
        if name != "--help":
            assert param.help, f"batchgate {' '.join(path)} {names[0]} has no help text"
        if param.envvar:
            assert documented(param.envvar), f"{param.envvar} ({names[0]}) is not in the docs"
            assert param.envvar in shown, f"{param.envvar} is not named in --help"


def test_every_documented_variable_is_read_by_a_command() -> None:
    read = {param.envvar for _, command in COMMANDS for param in command.params
            if isinstance(param, click.Option) and isinstance(param.envvar, str)}
    named = set(re.findall(r"\bBATCHGATE_[A-Z_]+\b", DOCS))
    assert named - TEST_ONLY_ENV <= read, sorted(named - TEST_ONLY_ENV - read)
    tests = "".join(p.read_text() for p in (ROOT / "tests").rglob("*.py"))
    assert all(name in tests for name in TEST_ONLY_ENV)


def test_every_consumer_flag_has_its_variable() -> None:
    consumer = dict((" ".join(p), c) for p, c in COMMANDS)["consumer"]
    for param in consumer.params:
        if isinstance(param, click.Option) and param.name != "help":
            assert param.envvar, f"batchgate consumer {param.opts[0]} has no env var"


# The packages docs/architecture.md lists module by module. batchgate/bench leaves the
# package for bench/ (issue 32, item 2), which documents its own.
LISTED = ("scheduler_core", "producer", "consumer", "batchgate")
ORDERED = ("scheduler_core/", "scheduler_core/ops/")  # each module after what it imports


def architecture() -> dict[str, list[tuple[str, str]]]:
    """docs/architecture.md's list of modules: package directory -> its entries (the name,
    then the text, continuation lines included), in the order listed."""
    block = (ROOT / "docs" / "architecture.md").read_text().split("```")[1]
    sections: dict[str, list[tuple[str, str]]] = {}
    entries: list[tuple[str, str]] = []
    for line in block.splitlines():
        if section := re.match(r"(\S+/)\s", line + " "):
            entries = sections.setdefault(section[1], [])
        elif entry := re.match(r"  (\S+)(.*)", line):
            entries.append((entry[1].rstrip(","), entry[2]))
        elif line.strip() and entries:
            name, text = entries[-1]
            entries[-1] = (name, f"{text} {line.strip()}")
    return sections


def test_architecture_lists_every_module() -> None:
    sections = architecture()
    missing = []
    for path in sorted(p for package in LISTED for p in (ROOT / package).rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if path.name == "__init__.py":
            continue
        section = max((s for s in sections if rel.startswith(s)), key=len, default=None)
        assert section is not None, f"docs/architecture.md has no section for {rel}"
        inner = rel[len(section):]
        entries = dict(sections[section])
        if "/" not in inner:
            listed = inner in entries
        else:  # a subpackage's entry names its modules
            text = entries.get(inner.split("/")[0] + "/", "")
            listed = re.search(rf"\b{re.escape(path.stem)}\b", text) is not None
        if not listed:
            missing.append(rel)
    assert not missing, f"not in docs/architecture.md: {missing}"


def test_architecture_lists_only_what_exists() -> None:
    gone = [section + name for section, entries in architecture().items()
            for name, _ in entries
            if name.endswith((".py", "/")) and not (ROOT / section / name).exists()]
    assert not gone, f"docs/architecture.md lists what the code lacks: {gone}"


def test_architecture_lists_the_protocol_and_its_tooling_in_import_order() -> None:
    """Read top to bottom, each module of scheduler_core and scheduler_core/ops uses only
    those listed above it."""
    sections = architecture()
    order = [(section + name)[:-3].replace("/", ".") for section in ORDERED
             for name, _ in sections[section] if name.endswith(".py")]
    graph = import_graph()
    late = [f"{module} imports {target}, listed below it"
            for i, module in enumerate(order) for target in sorted(graph[module])
            if target in order[i + 1:]]
    assert not late, late
