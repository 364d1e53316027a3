"""README.md stays short, every relative link and #anchor in README.md and docs/*.md
resolves, and every shell block says whether it runs as pasted (tests/docs_markdown.py;
tests/test_docs_commands.py runs the runnable ones in the slow set)."""

import os

from tests.docs_markdown import (
    ROOT,
    anchors,
    broken_links,
    github_anchor,
    markdown_files,
    read,
    shell_blocks,
)

MAX_README_LINES = 160


def test_readme_is_short_and_keeps_the_two_commands_at_the_top():
    lines = read("README.md").split("\n")
    assert len(lines) <= MAX_README_LINES, f"README.md has {len(lines)} lines"
    head = "\n".join(lines[:10])
    assert "bash scripts/quickstart.sh" in head and "bash scripts/test.sh" in head


def test_github_anchors():
    assert github_anchor("Where megamoe differs from Megatron-LM, and why") == \
        "where-megamoe-differs-from-megatron-lm-and-why"
    assert github_anchor("`--compile`") == "--compile"
    assert github_anchor("On GPUs") == "on-gpus"
    assert github_anchor("[Link](x.md) text_with_under") == "link-text_with_under"


def test_every_relative_link_and_anchor_resolves():
    files = markdown_files()
    assert len(files) >= 12, files
    bad = [b for f in files for b in broken_links(f)]
    assert not bad, "\n".join(bad)


def test_every_page_is_in_the_mkdocs_nav():
    with open(os.path.join(ROOT, "mkdocs.yml"), encoding="utf-8") as f:
        nav = f.read()
    pages = [f for f in markdown_files() if f.startswith("docs/")]
    missing = [p for p in pages if p[len("docs/"):] not in nav]
    assert not missing, missing


def test_every_shell_block_is_tagged_run_or_no_run_with_a_reason():
    blocks = [b for f in markdown_files() for b in shell_blocks(f)]
    untagged = [f"{b.path}:{b.line}" for b in blocks if b.lang != "bash" or not b.tag]
    assert not untagged, ("tag each ```bash block with <!-- run --> or <!-- no-run: REASON "
                          "--> on the line before it (and use bash, not sh/console): "
                          + ", ".join(untagged))
    assert all(b.reason for b in blocks if b.tag == "no-run")
    assert sum(b.tag == "run" for b in blocks) >= 10
    # each docs page starts with commands: its first block comes before its first "## "
    for f in markdown_files()[1:]:
        if f == "docs/index.md":
            continue
        first = read(f).split("\n## ")[0]
        assert "```bash" in first, f"{f}: no command block before its first section"


def test_link_check_finds_missing_files_and_headings():
    assert "what-megamoe-is" in anchors("docs/getting-started.md")
    text = ("# Page\n\n## Two words\n\n[ok](#two-words) [ok](getting-started.md#what-megamoe-is)"
            " [web](https://example.com/x#y) `[code](nope.md)`\n"
            "[a](getting-started.md#no-such) [b](nope.md) [c](#two)\n"
            "```\n[in a block](nope.md)\n```\n")
    bad = broken_links("docs/new-page.md", text)
    assert [b.split(": ", 1)[1] for b in bad] == [
        "getting-started.md#no-such (no such heading)", "nope.md (no such file)",
        "#two (no such heading)"], bad
