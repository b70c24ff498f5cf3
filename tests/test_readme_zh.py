"""README.zh-CN.md, the Chinese guide, keeps step with README.md: every code block of README.md is
in it with the same commands in the same order (comments may be translated), every number of
README.md's tables is in a row of its tables, its relative links reach files and headings that
exist, and each file links to the other."""

from __future__ import annotations

import importlib.util
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import ROOT

ENGLISH, CHINESE = ROOT / "README.md", ROOT / "README.zh-CN.md"

# the one reader of markdown tables (headings, code fences) is the documented-results checker's
spec = importlib.util.spec_from_file_location("reproduce_results", ROOT / "scripts" / "reproduce_results.py")
reproduce = importlib.util.module_from_spec(spec)
spec.loader.exec_module(reproduce)

# a number that is not part of a name (multi30k, wmt14_de_en): 2014, 3,000, 6:13, -86.6; 1-10 is 1 and 10
NUMBER = re.compile(r"(?<![A-Za-z0-9_.])-?\d+(?:[.,:]\d+)*")
LINK = re.compile(r"\]\(([^)\s]+)\)")


@dataclass
class Block:
    heading: str | None
    line: int            # the line of its opening fence
    commands: list[str]  # its lines as commands(): comments removed, whitespace collapsed, no empty lines


def command(line: str) -> str:
    """A line of a code block as the command it runs: without its comment (a ``#`` at the start or
    after white space, outside quotes, to the end of the line) and with white space collapsed."""
    quote, escaped = None, False
    for i, char in enumerate(line):
        if escaped:
            escaped = False
        elif char == "\\" and quote != "'":
            escaped = True
        elif quote:
            quote = None if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char == "#" and (i == 0 or line[i - 1].isspace()):
            line = line[:i]
            break
    return " ".join(line.split())


def code_blocks(path: Path) -> list[Block]:
    """The fenced code blocks of a markdown file, in order, each with the heading above it."""
    blocks, heading, block = [], None, None
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if line.startswith("```"):
            if block is None:
                block = Block(heading, number, [])
            else:
                blocks.append(block)
                block = None
        elif block is not None:
            if text := command(line):
                block.commands.append(text)
        elif line.startswith("#"):
            heading = line.lstrip("#").strip()
    return blocks


def block_problems(english: Path, chinese: Path) -> list[str]:
    """One line per code block of ``english`` that ``chinese`` lacks, or has out of order."""
    theirs, problems, position = code_blocks(chinese), [], 0
    for block in code_blocks(english):
        where = f"{english.name} line {block.line} (the block under '{block.heading}')"
        found = next((i for i in range(position, len(theirs)) if theirs[i].commands == block.commands), None)
        if found is not None:
            position = found + 1
            continue
        same = [other.line for other in theirs if other.commands == block.commands]
        if same:
            problems.append(f"{where}: {chinese.name} has it at line {same[0]}, out of {english.name}'s order")
            continue
        candidates = theirs[position:] or theirs
        nearest = max(candidates, key=lambda other: len(set(other.commands) & set(block.commands)), default=None)
        if nearest is None:
            problems.append(f"{where}: {chinese.name} has no code block left to hold it")
            continue
        lacks = [f"`{line}`" for line in block.commands if line not in nearest.commands]
        extra = [f"`{line}`" for line in nearest.commands if line not in block.commands]
        said = (f"lacks {', '.join(lacks)}" if lacks else "has the same lines in another order")
        said += f"; has instead {', '.join(extra)}" if extra else ""
        problems.append(f"{where}: {chinese.name}'s nearest block (line {nearest.line}) {said}; "
                        f"copy the commands as they are (only comments may be translated)")
    return problems


def numbers(cells: list[str]) -> Counter:
    return Counter(NUMBER.findall(" | ".join(cells)))


def table_problems(english: Path, chinese: Path) -> list[str]:
    """One line per row of ``english``'s tables whose numbers no row of ``chinese``'s tables has."""
    rows = [(line + i, numbers(cells)) for _, line, table in reproduce.markdown_tables(chinese)
            for i, cells in enumerate(table) if i != 1]
    problems = []
    for heading, line, table in reproduce.markdown_tables(english):
        for i, cells in enumerate(table):
            wanted = numbers(cells)
            if i == 1 or not wanted or any(not wanted - theirs for _, theirs in rows):
                continue
            nearest, theirs = max(rows, key=lambda row: (wanted & row[1]).total(), default=(None, Counter()))
            lacks = ", ".join(sorted((wanted - theirs).elements()))
            problems.append(f"{english.name} line {line + i} (the table under '{heading}'): no row of {chinese.name}'s "
                            f"tables has its numbers {', '.join(sorted(wanted.elements()))}"
                            + (f"; the nearest (line {nearest}) lacks {lacks}" if nearest else ""))
    return problems


def anchors(path: Path) -> set[str]:
    """The anchors of a markdown file's headings, as GitHub makes them: lower case, punctuation
    dropped, spaces as hyphens, a repeated one numbered."""
    found, seen, in_code = set(), Counter(), False
    for line in path.read_text(encoding="utf-8").splitlines():
        in_code ^= line.startswith("```")
        if line.startswith("#") and not in_code:
            slug = re.sub(r"[^\w\- ]", "", line.lstrip("#").strip().lower()).replace(" ", "-")
            found.add(slug if not seen[slug] else f"{slug}-{seen[slug]}")
            seen[slug] += 1
    return found


def link_problems(path: Path) -> list[str]:
    """One line per relative link of a markdown file (outside code) whose file or heading is not there."""
    problems, in_code = [], False
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        in_code ^= line.startswith("```")
        if in_code or line.startswith("```"):
            continue
        for target in LINK.findall(re.sub(r"`[^`]*`", "", line)):
            if re.match(r"[A-Za-z][A-Za-z0-9+.-]*:", target):
                continue  # https:, mailto:
            file, _, anchor = target.partition("#")
            linked = (path.parent / file) if file else path
            if not linked.exists():
                problems.append(f"{path.name} line {number}: the link {target} names {file}, which does not exist")
            elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
                problems.append(f"{path.name} line {number}: the link {target}: {file or path.name} has no heading '#{anchor}'")
    return problems


def test_every_code_block_of_the_english_readme_is_in_the_chinese_one_in_order():
    problems = block_problems(ENGLISH, CHINESE)
    assert not problems, "\n".join(problems)


def test_every_number_of_the_english_readmes_tables_is_in_the_chinese_tables():
    problems = table_problems(ENGLISH, CHINESE)
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("readme", [CHINESE, ENGLISH], ids=lambda p: p.name)
def test_relative_links_reach_files_and_headings_that_exist(readme):
    problems = link_problems(readme)
    assert not problems, "\n".join(problems)


def test_each_readme_links_to_the_other_in_its_first_lines():
    assert "](README.zh-CN.md)" in "".join(ENGLISH.read_text(encoding="utf-8").splitlines(keepends=True)[:5])
    assert "](README.md)" in "".join(CHINESE.read_text(encoding="utf-8").splitlines(keepends=True)[:5])


def test_comments_are_not_commands_but_quoted_and_glued_hashes_are():
    assert command("python train.py   model=lstm   # 或 lstm_luong") == "python train.py model=lstm"
    assert command("# 1. 安装") == ""
    assert command("curl -d '{\"a\": \"# x\"}' docs/x.md#anchor  # c") == "curl -d '{\"a\": \"# x\"}' docs/x.md#anchor"


def test_a_command_changed_in_one_readme_only_is_named_with_its_block(tmp_path):
    """The checks above fail, naming the block and the line, when the two files drift apart."""
    english, chinese = tmp_path / "README.md", tmp_path / "README.zh-CN.md"
    english.write_text(ENGLISH.read_text(encoding="utf-8"), encoding="utf-8")
    text = CHINESE.read_text(encoding="utf-8")
    old = "python train.py model=transformer        # 或 lstm、lstm_bahdanau、lstm_luong"
    assert old in text
    chinese.write_text(text.replace(old, "python train.py model=lstm        # 或 lstm、lstm_bahdanau、lstm_luong"),
                       encoding="utf-8")
    fence = ENGLISH.read_text(encoding="utf-8").splitlines().index("## First run") + 3
    zh_fence = text.splitlines().index("## 第一次运行") + 3
    assert block_problems(english, chinese) == [
        f"README.md line {fence} (the block under 'First run'): README.zh-CN.md's nearest block (line {zh_fence}) "
        "lacks `python train.py model=transformer`; has instead `python train.py model=lstm`; "
        "copy the commands as they are (only comments may be translated)"]
    # the same change in the English file alone; a comment translated differently changes nothing
    chinese.write_text(text.replace("# 或 lstm、lstm_bahdanau、lstm_luong", "# 其他模型"), encoding="utf-8")
    english.write_text(ENGLISH.read_text(encoding="utf-8").replace("model=transformer        # or",
                                                                   "model=transformer --x        # or"), encoding="utf-8")
    assert [p.split(":")[0] for p in block_problems(english, chinese)] == [f"README.md line {fence} (the block under 'First run')"]
    # two blocks swapped: each found, one out of order
    pieces = text.split("```bash")
    quickstart = next(i for i, piece in enumerate(pieces) if piece.startswith("\n# 1. "))
    pieces[quickstart:quickstart + 2] = pieces[quickstart + 1], pieces[quickstart]  # Quickstart after First run
    swapped = "```bash".join(pieces)
    chinese.write_text(swapped, encoding="utf-8")
    english.write_text(ENGLISH.read_text(encoding="utf-8"), encoding="utf-8")
    assert "out of README.md's order" in " ".join(block_problems(english, chinese))


def test_a_table_number_changed_in_one_readme_only_is_named_with_its_row(tmp_path):
    english, chinese = tmp_path / "README.md", tmp_path / "README.zh-CN.md"
    chinese.write_text(CHINESE.read_text(encoding="utf-8"), encoding="utf-8")
    text = ENGLISH.read_text(encoding="utf-8")
    row = "| `lstm` | 6:13 | 3,000 | 25.1 | 97.6 | 11.0 | -86.6 |"
    english.write_text(text.replace(row, row.replace("25.1", "25.3")), encoding="utf-8")
    number = text.splitlines().index(row) + 1
    problems = table_problems(english, chinese)
    assert len(problems) == 1 and problems[0].startswith(
        f"README.md line {number} (the table under 'First run'): no row of README.zh-CN.md's tables has its numbers")
    assert problems[0].endswith("lacks 25.3")


def test_a_link_to_a_missing_file_or_heading_is_named(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text("# Title\n\n## In every language: BLEU's tokenizer\n", encoding="utf-8")
    readme = tmp_path / "README.zh-CN.md"
    readme.write_text("[a](docs/a.md#in-every-language-bleus-tokenizer) [b](docs/b.md) [c](docs/a.md#nope)\n"
                      "`[x](nowhere.md)` [web](https://example.org/x)\n", encoding="utf-8")
    assert link_problems(readme) == [
        "README.zh-CN.md line 1: the link docs/b.md names docs/b.md, which does not exist",
        "README.zh-CN.md line 1: the link docs/a.md#nope: docs/a.md has no heading '#nope'"]
