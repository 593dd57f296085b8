"""docs/flags.md: every flag of every `pdserve` command, written from the parsers themselves.

    python -m deploy.flag_docs            rewrite docs/flags.md
    python -m deploy.flag_docs --check    exit 1 when docs/flags.md is not what the parsers say

The page is generated, never edited by hand, so it cannot drift from the code: a flag added, renamed or
given a new default changes the parser, and `tests/unit/test_flag_docs.py` fails until the page is
written again. docs/configuration.md explains the flags by topic and links here for the full list.
"""

from __future__ import annotations

import argparse
import os
import sys

PAGE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "flags.md")

HEADER = """# Every flag

Generated from the parsers by `python -m deploy.flag_docs`; do not edit (a test checks it is current).
What the flags are for, by topic: [configuration.md](configuration.md).
"""


def node_parser() -> argparse.ArgumentParser:
    from common.config import ServerArgs

    parser = argparse.ArgumentParser(prog="pdserve serve")
    ServerArgs.add_cli_args(parser)
    return parser


def router_parser() -> argparse.ArgumentParser:
    from router.cli import build_parser

    return build_parser()


def cluster_parser() -> argparse.ArgumentParser:
    from deploy.cluster_cli import build_parser

    return build_parser()


def convert_parser() -> argparse.ArgumentParser:
    from deploy.cli import convert_parser as build

    return build()


SECTIONS = [
    ("`pdserve serve`, `pdserve prefill`, `pdserve decode`",
     "One parser for the three node commands: `serve` runs a colocated node, `prefill` and `decode` set "
     "`--disaggregation-mode` themselves. A flag that does not apply to a role is refused there at start, "
     "with a message naming it.", node_parser),
    ("`pdserve router`", "sglang-router's PD flags; the router never loads torch.", router_parser),
    ("`pdserve cluster`",
     "The launcher's own flags. Any other flag is checked against the node parser and passed to every node "
     "unchanged.", cluster_parser),
    ("`pdserve convert`", "", convert_parser),
]


def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def _default(action: argparse.Action) -> str:
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
        return "off" if action.default is False else "on"
    if action.default is None or action.default == argparse.SUPPRESS:
        return ""
    if action.default == "":
        return '`""`'
    if isinstance(action.default, list):
        return "" if not action.default else _cell(" ".join(map(str, action.default)))
    return f"`{_cell(action.default)}`"


def _flag(action: argparse.Action) -> str:
    names = ", ".join(f"`{o}`" for o in action.option_strings)
    if action.choices:
        names += " " + "\\|".join(f"`{c}`" if c != "" else '`""`' for c in action.choices)
    elif action.metavar:
        names += f" {_cell(action.metavar)}"
    return names


def _help(action: argparse.Action) -> str:
    text = action.help or ""
    if "%(" in text:
        text = text % {"default": action.default, "prog": "", "choices": action.choices}
    return _cell(text)


def table(parser: argparse.ArgumentParser) -> list[str]:
    rows = ["| flag | default | meaning |", "|---|---|---|"]
    for action in parser._actions:
        if not action.option_strings or action.help == argparse.SUPPRESS or "--help" in action.option_strings:
            continue
        rows.append(f"| {_flag(action)} | {_default(action)} | {_help(action)} |")
    positionals = [a for a in parser._actions if not a.option_strings]
    for action in positionals:
        rows.append(f"| `{action.dest}` (positional) | {_default(action)} | {_help(action)} |")
    return rows


def render() -> str:
    lines = [HEADER]
    for title, intro, build in SECTIONS:
        lines.append(f"## {title}\n")
        if intro:
            lines.append(intro + "\n")
        lines.extend(table(build()))
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    text = render()
    if "--check" in argv:
        with open(PAGE, encoding="utf-8") as f:
            current = f.read()
        if current != text:
            print(f"{PAGE} is stale: run python -m deploy.flag_docs", file=sys.stderr)
            return 1
        return 0
    with open(PAGE, "w", encoding="utf-8") as f:
        f.write(text)
    print(PAGE)
    return 0


if __name__ == "__main__":
    sys.exit(main())
