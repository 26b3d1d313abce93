"""The README is a guide a newcomer can trust: short, every link in it and in docs/ lands on a file
(and a heading) of the repository, every flag it names is one a pdserve command parses (or, on the
line that runs a benchmark, one that benchmark declares), every `python -m` module it and the docs
name exists, and every test its feature table cites is a file.

No process is started: each command's parser is built the way `pdserve <command>` builds it and
caught before it parses anything."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import re
from pathlib import Path

import pytest

from pdserve.cli import SUBCOMMANDS

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
MAX_README_LINES = 300
# Every page whose links and modules are checked: the README, the docs and the figures.
PAGES = [README, *sorted((ROOT / "docs").glob("*.md")), ROOT / "benchmarks/RESULTS.md"]
# Flags of other tools that the README shows beside pdserve's: each is accepted only on a line
# that names its tool.
FOREIGN_FLAGS = {"docker-compose": {"--profile", "--build"}}

LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
FLAG = re.compile(r"(?<![\w-])--(\[no-\])?([a-z][a-z0-9-]*)")
MODULE = re.compile(r"python -m\s+([A-Za-z_][\w.]*\w)")
TEST_FILE = re.compile(r"tests/[\w/]+\.py")


def prose_and_code(path: Path) -> tuple[list[str], list[str]]:
    """The page's lines outside fenced code blocks, and those inside them."""
    prose, code, fenced = [], [], False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif fenced:
            code.append(line)
        else:
            prose.append(line)
    return prose, code


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: links reduced to their text, lower case, punctuation
    dropped, spaces made hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip())
    return re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading's anchor, repeats numbered as GitHub numbers them (``name-1``, ...)."""
    found: set[str] = set()
    for line in prose_and_code(path)[0]:
        heading = re.match(r"#{1,6} (.+)", line)
        if heading:
            base = slug(heading.group(1))
            name, count = base, 0
            while name in found:
                count += 1
                name = f"{base}-{count}"
            found.add(name)
    return found


def links(path: Path) -> list[str]:
    return [target for line in prose_and_code(path)[0] for target in LINK.findall(line)]


class _Built(Exception):
    """Raised in place of parsing: carries the parser a command built."""

    def __init__(self, parser: argparse.ArgumentParser) -> None:
        self.parser = parser


def command_parsers() -> dict[str, argparse.ArgumentParser]:
    """Each `pdserve` subcommand's parser, built by its own main() as the CLI dispatches to it,
    and taken at the moment it would parse: nothing runs."""

    def caught(self, *args, **kwargs):
        raise _Built(self)

    parsers = {}
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(argparse.ArgumentParser, "parse_args", caught)
        patch.setattr(argparse.ArgumentParser, "parse_known_args", caught)
        for command, (module, _) in SUBCOMMANDS.items():
            try:
                importlib.import_module(module).main([])
            except _Built as built:
                parsers[command] = built.parser
            else:
                raise AssertionError(f"pdserve {command} ran without parsing its arguments")
    return parsers


@pytest.fixture(scope="module")
def known_flags() -> set[str]:
    parsers = command_parsers()
    assert set(parsers) == set(SUBCOMMANDS)
    return {flag for parser in parsers.values() for flag in parser._option_string_actions}


def flags_named(text_lines: list[str]) -> list[tuple[str, str]]:
    """(flag, line) for every `--flag` named; `--[no-]flag` names both forms."""
    named = []
    for line in text_lines:
        for negatable, name in FLAG.findall(line):
            named.append((f"--{name}", line))
            if negatable:
                named.append((f"--no-{name}", line))
    return named


def declares(module: str, flag: str) -> bool:
    """Whether ``module``'s own parser (a benchmark's, run on the same line) declares ``flag``."""
    spec = importlib.util.find_spec(module)
    origin = spec.origin if spec else None
    return origin is not None and f'"{flag}"' in Path(origin).read_text()


def feature_rows() -> list[list[str]]:
    """The cells of every row of the README's feature table."""
    section = README.read_text().split("\n## Features\n", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| ")]
    header, *body = rows
    assert [cell.strip() for cell in header.strip("|").split("|")] == [
        "Feature", "Flag(s)", "Doc", "Test"
    ]  # fmt: skip
    return [[cell.strip() for cell in re.split(r"(?<!\\)\|", row.strip("|"))] for row in body]


def test_the_readme_is_a_guide_of_at_most_300_lines():
    lines = len(README.read_text().splitlines())
    assert lines <= MAX_README_LINES, f"README.md has {lines} lines, over {MAX_README_LINES}"


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(ROOT)))
def test_every_relative_link_lands_on_a_file_and_a_heading(page):
    bad = []
    for target in links(page):
        if re.match(r"[a-z]+:", target):
            continue  # http:, https:, mailto:: not the repository's
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists() or ROOT not in (file, *file.parents):
            bad.append(f"{target} (no such file in the repository)")
        elif anchor and (file.suffix != ".md" or anchor not in anchors(file)):
            bad.append(f"{target} (no heading #{anchor} in {file.relative_to(ROOT)})")
    assert not bad, f"{page.relative_to(ROOT)}: broken links: {bad}"


def test_every_flag_the_readme_names_is_parsed_by_a_pdserve_command(known_flags):
    prose, code = prose_and_code(README)
    bad = []
    for flag, line in flags_named(prose + code):
        if flag in known_flags:
            continue
        if any(tool in line and flag in flags for tool, flags in FOREIGN_FLAGS.items()):
            continue
        if any(declares(module, flag) for module in MODULE.findall(line)):
            continue
        bad.append(f"{flag} in: {line.strip()}")
    assert not bad, f"README.md names flags no pdserve command parses: {bad}"


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(ROOT)))
def test_every_python_module_named_exists(page):
    text = page.read_text()
    # A placeholder (benchmarks.NAME, benchmarks.GROUP.NAME) stands for any module.
    named = {m for m in MODULE.findall(text) if not any(p.isupper() for p in m.split("."))}
    missing = [module for module in sorted(named) if importlib.util.find_spec(module) is None]
    assert not missing, f"{page.relative_to(ROOT)} names modules that do not exist: {missing}"


def test_every_feature_names_a_flag_a_doc_and_a_test_that_exist():
    rows = feature_rows()
    assert len(rows) >= 30
    for feature, flags, doc, tests in rows:
        assert flags, f"{feature}: no flag or field named"
        assert LINK.search(doc), f"{feature}: no doc linked"
        cited = TEST_FILE.findall(tests)
        assert cited, f"{feature}: no test file named"
        missing = [test for test in cited if not (ROOT / test).is_file()]
        assert not missing, f"{feature}: no such test file {missing}"
