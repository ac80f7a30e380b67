"""The README and docs/: a front page of bounded size, links that lead somewhere, pages about the product."""
from __future__ import annotations

import json
import re
from pathlib import Path
from urllib.parse import unquote

import pytest

from cflib.paths import project_root

ROOT = project_root()
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
# The pages whose links and words are checked: the manual, and the research probes' page beside the package.
CHECKED_PAGES = [*PAGES, ROOT / "benchmarks" / "README.md"]
README_MAX_CHARS = 10_000

FENCE = re.compile(r"^(```|~~~).*?^\1[ \t]*$", re.S | re.M)
CODE_SPAN = re.compile(r"(`+)(?!`).+?(?<!`)\1", re.S)
# [text](target) and ![alt](target); the text may hold one level of brackets (a badge, a code span).
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE_DEFINITION = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$", re.M)
HTML_TARGET = re.compile(r"<(?:a|img)\b[^>]*?\b(?:href|src)\s*=\s*[\"']([^\"']+)[\"']", re.I)
HEADING = re.compile(r"^\s{0,3}#{1,6}\s+(.+?)\s*#*\s*$", re.M)
EXTERNAL = re.compile(r"^[a-z][a-z0-9+.-]*:", re.I)  # http:, https:, mailto:, ...
# A page speaks of the product as it is: no tracker references.
TRACKER = re.compile(r"\bissues?\b|(?<![\w&/])#\d+\b", re.I)
# The project stands alone: nothing in it cites notes kept outside it or a path on one machine. Each letter class
# ([N], [k], ...) keeps this line from matching itself.
OUTSIDE_CITATION = re.compile(r"\b(?:DESIG[N]|METHO[D])\b|(?i:\b(?:desig[n]|metho[d])[._]md\b)|/wor[k]/|\.\./share[d]\b"
                              r"|(?<![\w.])/(?:hom[e]|User[s])/\w")
# The trees and files the project ships; outputs/ holds records of past runs, evidence kept as it was written.
SHIPPED = ("cflib", "benchmarks", "tests", "notebooks", "docs", "params", "examples", ".ci", "README.md", "Makefile",
           "pyproject.toml", "environment.yml")
# A code comment or docstring citing a page of the manual: docs/<page>.md, optionally #<anchor>.
DOC_CITATION = re.compile(r"\bdocs/([\w-]+\.md)(?:#([\w-]+))?")


def shipped_files() -> list[Path]:
    """Every text file of the shipped trees (bytecode and other binaries left out)."""
    found = []
    for name in SHIPPED:
        top = ROOT / name
        for path in sorted(top.rglob("*")) if top.is_dir() else [top] if top.is_file() else []:
            if path.is_file() and "__pycache__" not in path.parts:
                try:
                    path.read_text()
                except UnicodeDecodeError:
                    continue
                found.append(path)
    return found


def outside_citations(text: str) -> list[str]:
    return [f"line {text[:match.start()].count(chr(10)) + 1}: {match.group(0)!r}"
            for match in OUTSIDE_CITATION.finditer(text)]


def broken_doc_citations(text: str, root: Path = ROOT) -> list[str]:
    """Each docs/<page>.md[#anchor] cited in `text` whose page, or heading, does not exist."""
    broken = []
    for page, anchor in DOC_CITATION.findall(text):
        path = root / "docs" / page
        if not path.is_file():
            broken.append(f"docs/{page}: no such page")
        elif anchor and anchor not in anchors(path):
            broken.append(f"docs/{page}#{anchor}: no heading with that anchor")
    return broken


def prose(text: str) -> str:
    """The page without fenced code blocks and inline code spans: what is rendered as text and links."""
    return CODE_SPAN.sub("", FENCE.sub("", text))


def link_targets(text: str) -> list[str]:
    body = prose(text)
    return [*LINK.findall(body), *REFERENCE_DEFINITION.findall(body), *HTML_TARGET.findall(body)]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: markup dropped, lower case, punctuation out, spaces to hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link keeps its text
    text = re.sub(r"<[^>]+>", "", text).replace("`", "").lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Every anchor a markdown page offers; a repeated heading gets -1, -2, ... as on GitHub."""
    found: set[str] = set()
    counts: dict[str, int] = {}
    for heading in HEADING.findall(FENCE.sub("", page.read_text())):
        base = slug(heading)
        found.add(base if base not in counts else f"{base}-{counts[base]}")
        counts[base] = counts.get(base, 0) + 1
    return found


def broken_links(page: Path) -> list[str]:
    """Each relative link or image of `page` whose file, or #anchor in a markdown file, does not exist."""
    broken = []
    for target in link_targets(page.read_text()):
        if EXTERNAL.match(target):
            continue
        path_part, _, anchor = target.partition("#")
        resolved = (page.parent / unquote(path_part)).resolve() if path_part else page
        if not resolved.exists():
            broken.append(f"{target}: no such file {resolved}")
        elif anchor and resolved.suffix == ".md" and unquote(anchor).lower() not in anchors(resolved):
            broken.append(f"{target}: {resolved.name} has no heading with anchor #{anchor}")
    return broken


def test_readme_is_a_front_page():
    size = len(README.read_text())
    assert size <= README_MAX_CHARS, (f"README.md has {size:,} characters (at most {README_MAX_CHARS:,}): "
                                      "move the detail into docs/")


QUICKSTART_RECORD = ROOT / "outputs" / "records" / "train_sft_quickstart_cpu.json"


def quickstart_account(record: dict) -> str:
    """What `make train` did, in the README's words, from the quickstart's record."""
    final, start = record["eval"]["final"], record["eval"]["at_start"]
    by_task = final["exact_match"]
    minutes, seconds = divmod(round(record["timing"]["wall_s"]), 60)
    return (f"a {record['params_total'] / 1e6:.1f}M-parameter TR-MoE from scratch on two embedded synthetic tasks "
            f"(three-digit addition, upper-casing a word). On a 2-core CPU the run took {minutes} min {seconds} s "
            f"(commit {record['framework']['cflib_commit'][:7]}; set-up and data generation apart) and lifted "
            f"held-out exact match from {start['exact_match']['overall']:.3f} to {by_task['overall']:.3f} "
            f"(addition {by_task['addition']:.2f}, upper-casing {by_task['uppercase']:.2f}) in "
            f"{record['schedule']['steps_done']:,} optimizer steps over {record['schedule']['epochs_started']} epochs, "
            f"held-out loss {start['loss']:.3f} -> {final['loss']:.3f}")


def test_the_readme_s_quickstart_figures_are_its_record_s():
    """The figures README.md and params/quickstart.yaml give for `make train` are its committed record's."""
    record = json.loads(QUICKSTART_RECORD.read_text())
    assert quickstart_account(record) in " ".join(README.read_text().split())
    size = f"a {record['params_total'] / 1e6:.1f}M-parameter TR-MoE"
    comment = " ".join(line.lstrip("# ") for line in (ROOT / "params" / "quickstart.yaml").read_text().splitlines()
                       if line.startswith("#"))
    assert size in comment and not re.search(r"\b\d+(\.\d+)?\b(?!M-parameter)", comment.replace(size, "")), comment


def test_the_manual_is_in_docs_and_the_readme_links_to_every_page():
    pages = sorted(path.relative_to(ROOT).as_posix() for path in PAGES[1:])
    assert pages, "docs/ holds no pages"
    linked = {target.partition("#")[0] for target in link_targets(README.read_text())}
    assert not set(pages) - linked, f"README.md does not link to {sorted(set(pages) - linked)}"


@pytest.mark.parametrize("page", CHECKED_PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_relative_link_and_image_resolves(page):
    assert link_targets(page.read_text()), f"{page.name}: no links found (is the link pattern still right?)"
    broken = broken_links(page)
    assert not broken, f"{page.relative_to(ROOT)}:\n" + "\n".join(broken)


@pytest.mark.parametrize("page", CHECKED_PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_pages_speak_of_the_product_not_of_its_tracker(page):
    hits = [f"line {text[:match.start()].count(chr(10)) + 1}: {match.group(0)!r}"
            for text in [page.read_text()] for match in TRACKER.finditer(text)]
    assert not hits, f"{page.relative_to(ROOT)} refers to issues: {hits}"


def test_the_project_cites_nothing_outside_itself():
    files = shipped_files()
    assert any(path.suffix == ".py" for path in files) and any(path.suffix == ".md" for path in files)
    hits = {path.relative_to(ROOT).as_posix(): found
            for path in files if (found := outside_citations(path.read_text()))}
    assert not hits, f"citations of notes outside the project or of machine paths (cite docs/ instead): {hits}"


def test_code_citing_the_manual_names_pages_and_headings_that_exist():
    cited = broken = 0
    problems = {}
    for path in shipped_files():
        if path.suffix in (".py", ".ipynb") or path.name == "Makefile":
            text = path.read_text()
            cited += len(DOC_CITATION.findall(text))
            if found := broken_doc_citations(text):
                problems[path.relative_to(ROOT).as_posix()] = found
                broken += len(found)
    assert cited, "no docs/ citation found in the code (is DOC_CITATION still right?)"
    assert not problems, f"{broken} citation(s) of the manual lead nowhere: {problems}"


# --- the checks themselves ---------------------------------------------------------------

def test_a_broken_link_image_or_anchor_is_caught(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "other.md").write_text("# Other page\n\n## Two `words`, here!\n\n## Two words here\n")
    (tmp_path / "shot.png").write_bytes(b"png")
    page = tmp_path / "docs" / "page.md"
    page.write_text(
        "# Page\n\n[fine](other.md#two-words-here) [repeat](other.md#two-words-here-1) [self](#page)\n"
        "![fine](../shot.png) [web](https://example.com/missing) `[code](nowhere.md)`\n"
        "```\n[fenced](nowhere.md)\n```\n"
        "[gone](missing.md) ![gone](../missing.png) [anchor](other.md#no-such-heading) [here](#nothing)\n"
        '<img src="../absent.png">\n[ref]: ../absent.md\n')
    assert broken_links(page) == [
        f"missing.md: no such file {tmp_path / 'docs' / 'missing.md'}",
        f"../missing.png: no such file {tmp_path / 'missing.png'}",
        "other.md#no-such-heading: other.md has no heading with anchor #no-such-heading",
        "#nothing: page.md has no heading with anchor #nothing",
        f"../absent.md: no such file {tmp_path / 'absent.md'}",
        f"../absent.png: no such file {tmp_path / 'absent.png'}",
    ]


@pytest.mark.parametrize("text, found", [
    ("fixed in issue 4", True), ("see #12", True), ("Issues: none", True),
    ("tissue paper", False), ("a 2-D weighting", False), ("`&#8203;`", False), ("[x](page.md#step-3)", False),
])
def test_tracker_references_are_recognised(text, found):
    assert bool(TRACKER.search(text)) is found


def test_github_anchors():
    assert slug("Tuning the micro-batch to a memory budget") == "tuning-the-micro-batch-to-a-memory-budget"
    assert slug("2-D loss weighting") == "2-d-loss-weighting"
    assert slug("`make lab`") == "make-lab"
    assert slug("The TR-MoE block: three designs") == "the-tr-moe-block-three-designs"


# Written in pieces, here and below, so that this file does not cite what it tests for.
@pytest.mark.parametrize("text, found", [
    ("written from DESIG" "N.md alone", True), ("(METHO" "D: ||a - b||)", True), ("see desig" "n_md", True),
    ("/wor" "k/shared/notes", True), ("../share" "d/x", True), ("/hom" "e/alice/run", True),
    ("three designs", False), ("the method of moments", False), ("docs/formats.md#derived-buffers", False),
    ("outputs/runs/x", False), ("a shared/ folder", False), ("/usr/bin/chromium", False),
])
def test_outside_citations_are_recognised(text, found):
    assert bool(outside_citations(text)) is found


def test_a_citation_of_a_missing_page_or_heading_is_caught(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "page.md").write_text("# Page\n\n## Derived buffers\n")
    text = ("see docs/" "page.md#derived-buffers, docs/" "page.md, docs/" "page.md#gone and docs/" "none.md#x")
    assert broken_doc_citations(text, tmp_path) == ["docs/" "page.md#gone: no heading with that anchor",
                                                    "docs/" "none.md: no such page"]
