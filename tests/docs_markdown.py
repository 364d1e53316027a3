"""Reading README.md and docs/*.md: headings and their GitHub anchors, relative links, and
the fenced shell blocks with their run / no-run tags (tests/test_docs.py,
tests/test_docs_commands.py).

A ```bash block is tagged by an HTML comment on the line before its fence:
`<!-- run -->` (the slow set pastes it into bash on the CPU) or
`<!-- no-run: REASON -->`. The tag is a comment, not part of the fence's info string,
because Markdown renderers (MkDocs among them) stop treating ```bash no-run: ... as a
fence."""

from __future__ import annotations

import os
import re
import unicodedata
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})\s*([\w+-]*)")
SHELL_LANGS = {"bash", "sh", "shell", "console", "zsh"}
TAG = re.compile(r"^\s*<!--\s*(run|no-run:\s*(?P<reason>\S.*?))\s*-->\s*$")
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


@dataclass
class Block:
    path: str          # relative to ROOT
    line: int          # 1-based line of the opening fence
    lang: str
    tag: str           # "run", "no-run" or "" (untagged)
    reason: str
    code: str


def markdown_files() -> list[str]:
    """README.md, then docs/getting-started.md, then the other docs pages by name."""
    docs = sorted(f for f in os.listdir(os.path.join(ROOT, "docs")) if f.endswith(".md"))
    first = ["getting-started.md"] if "getting-started.md" in docs else []
    return ["README.md"] + [f"docs/{f}" for f in first + [d for d in docs if d not in first]]


def read(path: str) -> str:
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        return f.read()


def split_fences(text: str) -> tuple[list[tuple[int, str]], list[Block]]:
    """(the lines outside fenced blocks with their 1-based numbers, the fenced blocks)."""
    lines = text.split("\n")
    prose: list[tuple[int, str]] = []
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            prose.append((i + 1, lines[i]))
            i += 1
            continue
        indent, fence, lang = m.group(1), m.group(2), m.group(3).lower()
        prev = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        t = TAG.match(prev)
        tag = ("run" if t.group(1) == "run" else "no-run") if t else ""
        body = []
        j = i + 1
        while j < len(lines) and not lines[j].strip().startswith(fence[:3]):
            body.append(lines[j][len(indent):] if lines[j].startswith(indent) else lines[j])
            j += 1
        blocks.append(Block("", i + 1, lang, tag, (t.group("reason") or "") if t else "",
                            "\n".join(body)))
        i = j + 1
    return prose, blocks


def shell_blocks(path: str) -> list[Block]:
    _, blocks = split_fences(read(path))
    out = [b for b in blocks if b.lang in SHELL_LANGS]
    for b in out:
        b.path = path
    return out


def github_anchor(heading: str) -> str:
    """GitHub's anchor of a heading: its rendered text (no code ticks, links by their text)
    lower-cased, punctuation other than - and _ dropped, spaces as hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def mkdocs_anchor(heading: str) -> str:
    """MkDocs' anchor of a heading (Python-Markdown's toc slugify over the rendered text):
    as GitHub's, but runs of hyphens and spaces collapse to one hyphen and the ends are
    stripped, so "`--fp16` and x" is "fp16-and-x" there and "--fp16-and-x" on GitHub."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode("ascii")
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def anchors(path: str, text: str | None = None, site: bool = False) -> set[str]:
    """The anchors of `path`'s headings on GitHub, or (site=True) in the MkDocs site."""
    prose, _ = split_fences(read(path) if text is None else text)
    seen: dict[str, int] = {}
    out = set()
    for _, line in prose:
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        slug = (mkdocs_anchor if site else github_anchor)(m.group(1))
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}{'_' if site else '-'}{n}")
    return out


def broken_links(path: str, text: str | None = None) -> list[str]:
    """Each relative link or #anchor in `path` (or in `text` as if it were that file) that
    does not resolve, as 'path:line: link (why)'."""
    text = read(path) if text is None else text
    prose, _ = split_fences(text)
    here = os.path.dirname(os.path.join(ROOT, path))
    bad = []
    for n, line in prose:
        for target in LINK.findall(re.sub(r"`[^`]*`", "", line)):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):
                continue  # http:, https:, mailto:
            file_part, _, anchor = target.partition("#")
            dest = os.path.normpath(os.path.join(here, file_part)) if file_part else \
                os.path.join(ROOT, path)
            if file_part and not os.path.exists(dest):
                bad.append(f"{path}:{n}: {target} (no such file)")
            elif anchor and dest.endswith(".md"):
                own = dest == os.path.join(ROOT, path)
                rel = os.path.relpath(dest, ROOT)
                if anchor not in anchors(rel, text if own else None):
                    bad.append(f"{path}:{n}: {target} (no such heading)")
                elif rel.startswith("docs") and anchor not in anchors(
                        rel, text if own else None, site=True):
                    bad.append(f"{path}:{n}: {target} (not an anchor in the MkDocs site: "
                               "avoid a heading that starts with -- or other punctuation)")
    return bad
