"""Every flag and subcommand says what it is in `--help`: the product's command line (walked at run
time, every parser the `tokenmill` command builds) and the scripts under benchmarks/ and eval/ (read
from their source: they build their parsers inside main(), next to heavy imports). A flag added
without a help text fails here, naming it."""

from __future__ import annotations

import argparse
import ast
import collections
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT_DIRS = ("benchmarks", "eval")


def _undocumented(parser: argparse.ArgumentParser, path: str) -> list[str]:
    """The flags and subcommands of `parser` and of its subparsers, recursively, that have no help
    text; -h and flags hidden on purpose (argparse.SUPPRESS) are documented enough."""
    parser.format_help()  # a help text that does not format (a stray %) breaks --help
    missing = []
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        if isinstance(action, argparse._SubParsersAction):
            helps = {choice.dest: choice.help for choice in action._choices_actions}
            for name, sub in action.choices.items():
                if not helps.get(name):
                    missing.append(f"{path} {name} (subcommand)")
                missing += _undocumented(sub, f"{path} {name}")
            continue
        if not action.help or not action.help.strip():
            missing.append(f"{path} {'/'.join(action.option_strings) or action.dest}")
    return missing


def test_every_product_flag_and_subcommand_has_help():
    from tokenmill.bench.cli import build_parser as build_bench_parser
    from tokenmill.entrypoints.cli import build_parser

    missing = _undocumented(build_parser(), "tokenmill") + _undocumented(build_bench_parser(), "bench standalone")
    assert not missing, "no help text: " + ", ".join(missing)


def _script_calls_without_help(source: str) -> list[tuple[int, str]]:
    """(line, call) for each add_argument / add_parser call in `source` without a non-empty help=, or
    with a literal help text that argparse cannot format."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in ("add_argument", "add_parser")
        ):
            continue
        help_value = next((k.value for k in node.keywords if k.arg == "help"), None)
        if help_value is None or (isinstance(help_value, ast.Constant) and not str(help_value.value or "").strip()):
            found.append((node.lineno, ast.unparse(node)))
        elif isinstance(help_value, ast.Constant) and isinstance(help_value.value, str):
            try:
                help_value.value % collections.defaultdict(str)  # argparse fills %(name)s from the action
            except (ValueError, TypeError):
                found.append((node.lineno, ast.unparse(node)))
    return found


def test_every_benchmark_and_eval_script_flag_has_help():
    scripts = sorted(
        p
        for d in SCRIPT_DIRS
        for p in (ROOT / d).rglob("*.py")
        if "build" not in p.relative_to(ROOT).parts  # the peers' builds and virtual environments (git ignores them)
    )
    assert len(scripts) > 20  # the walk found the scripts
    missing = [
        f"{script.relative_to(ROOT)}:{line}: {call}"
        for script in scripts
        for line, call in _script_calls_without_help(script.read_text())
    ]
    assert not missing, "no (or a broken) help text:\n" + "\n".join(missing)


def test_the_script_check_catches_a_flag_without_help():
    """The source check is not vacuous: it flags what it should and passes what it should."""
    source = (
        "ap.add_argument('--a', help='x (default: %(default)s)')\n"
        "ap.add_argument('--b', default=1)\n"
        "ap.add_argument('--c', help='')\n"
        "sub.add_parser('run')\n"
        "ap.add_argument('--d', help='50% of it')\n"
        "ap.add_argument('--e', help=argparse.SUPPRESS)\n"
    )
    assert [line for line, _ in _script_calls_without_help(source)] == [2, 3, 4, 5]
