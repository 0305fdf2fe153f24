"""Every shell block in README.md and docs/*.md pastes into zsh with its default options (and into
bash): a ```bash, ```sh, ```shell, ```zsh or ```console block holds commands only; output goes
in a ```text block and explanations in the prose around the block.

The rules, each a failure of a paste into zsh without `setopt interactive_comments`:
- no `#` comment, on its own line or after a command: zsh passes the words to the command as
  arguments, and an apostrophe in one opens a quote that swallows the next line;
- no literal `...` outside quotes: a placeholder is a `$VARIABLE` or a word the prose names;
- no unquoted `*`, `?`, `[` or `]` (outside `$((...))`): zsh stops on a pattern that matches no
  file ("no matches found", "bad pattern"), so `[--flag X]` is not a way to show an option;
- the block parses under `zsh -f -i -n` (zsh's defaults, read as a paste is) and `bash -n`.

`shell_blocks(path)` and `problems(block)` are the walker; other tests may import them.
zsh is installed by scripts/test.sh; without it the parse checks skip, except under CI=true,
where they fail. Cost: cheap (~0.3 s for the file: a zsh and a bash parse per block).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
SHELL_FENCES = {"bash", "sh", "shell", "zsh", "console"}
GLOB_CHARACTERS = "*?[]"
WORD_BREAKS = " \t\n;&|()"


@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # of the block's first command line in the file, 1-based
    text: str

    def where(self, offset: int = 0) -> str:
        path = self.path.relative_to(REPO) if self.path.is_relative_to(REPO) else self.path
        return f"{path}:{self.line + offset}"


def shell_blocks(path: Path) -> list[Block]:
    """The fenced shell blocks of a markdown file, in order."""
    blocks, fence, start, body = [], None, 0, []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if fence is None and line.startswith("```"):
            fence, start, body = line[3:].strip(), number + 1, []
        elif fence is not None and line.startswith("```"):
            if fence in SHELL_FENCES:
                blocks.append(Block(path, start, "\n".join(body) + "\n"))
            fence = None
        elif fence is not None:
            body.append(line)
    return blocks


def problems(block: Block) -> list[str]:
    """What in the block breaks a paste into zsh's defaults, one line each (parses excluded)."""
    text, found, quote, i = block.text, [], None, 0

    def report(at: int, what: str) -> None:
        message = f"{block.where(text.count(chr(10), 0, at))}: {what}"
        if message not in found:
            found.append(message)

    while i < len(text):
        c = text[i]
        if quote == "'":
            quote = None if c == "'" else quote
        elif quote == '"':
            i += c == "\\"
            quote = None if c == '"' else quote
        elif c == "\\":
            i += 1
        elif c in "'\"":
            quote = c
        elif text.startswith("$((", i):
            i = text.find("))", i) + 1 or len(text)
        elif c == "#" and (i == 0 or text[i - 1] in WORD_BREAKS):
            report(i, "a `#` comment (zsh passes it as arguments): move it to the prose")
        elif text.startswith("...", i):
            report(i, "a literal `...`: write the value, or a $VARIABLE the prose names")
            i += 2
        elif c in GLOB_CHARACTERS:
            report(i, f"an unquoted `{c}` (zsh: no matches found): quote it or drop the brackets")
        i += 1
    return found


def parse_errors(shell: list[str], block: Block) -> str | None:
    """The shell's complaint about the block's syntax, or None when it parses."""
    done = subprocess.run(
        shell,
        input=block.text,
        capture_output=True,
        text=True,
        env={"PATH": os.environ["PATH"], "TERM": "dumb", "HOME": "/nonexistent"},
        timeout=30,
    )
    complaints = re.findall(r"(?:zsh|bash): .*", done.stderr)
    if done.returncode == 0 and not complaints:
        return None
    return f"{block.where()}: {' '.join(shell)}: {'; '.join(complaints) or done.stderr.strip()}"


def needs_zsh() -> None:
    """Skip without zsh, except under CI=true: CI must run the parse checks."""
    if shutil.which("zsh"):
        return
    reason = "zsh is not installed (apt-get install zsh; scripts/test.sh installs it)"
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(f"CI=true but {reason}")
    pytest.skip(reason)


BLOCKS = [block for path in DOCS for block in shell_blocks(path)]


@pytest.mark.parametrize("block", BLOCKS, ids=[block.where() for block in BLOCKS])
def test_shell_block_pastes_into_zsh(block):
    """A README/docs shell block has no comments, `...` or bare globs, and parses in zsh and bash.
    Cheap (~10 ms a block)."""
    found = [*problems(block), parse_errors(["bash", "-n"], block)]
    if shutil.which("zsh"):
        found.append(parse_errors(["zsh", "-f", "-i", "-n"], block))
    found = [line for line in found if line]
    assert not found, "\n".join(found)
    needs_zsh()


def test_walker_finds_every_fence_kind(tmp_path):
    """shell_blocks takes bash/sh/shell/zsh/console fences with their line, not text or bare ones.
    Cheap (~1 ms)."""
    page = tmp_path / "page.md"
    page.write_text(
        "intro\n```bash\necho 1\n```\n```text\nout # put\n```\n```\nplain\n```\n"
        "```sh\necho 2\n```\n```shell\necho 3\n```\n```console\necho 4\n```\n"
    )
    blocks = shell_blocks(page)
    assert [(b.line, b.text) for b in blocks] == [
        (3, "echo 1\n"),
        (12, "echo 2\n"),
        (15, "echo 3\n"),
        (18, "echo 4\n"),
    ]


@pytest.mark.parametrize(
    "text, kinds",
    [
        ("python -m x --budget 100   # spends nothing\n", ["comment"]),
        ("# the engine's estimate (disk), first\npython -m x\n", ["comment"]),
        ("python -m eagle3.compare A.json B.json ...\n", ["`...`"]),
        ("python -m x --data DIR [--json OUT]\n", ["`[`", "`]`"]),
        ("python -m x --bench 'a*' \"b...\" 'x # y' url#frag $((8 * N)) \\#\n", []),
        ("python -m x 'data.dirs=[/a]' --flag \\\n    --next $N\n", []),
    ],
)
def test_problems_table(text, kinds, tmp_path):
    """The lexical rules: comments, `...` and bare globs found, quoted or escaped ones left alone.
    Cheap (~1 ms each)."""
    found = problems(Block(tmp_path, 1, text))
    assert [kind for kind in kinds if not any(kind in line for line in found)] == []
    assert len(found) == len(kinds)


def test_zsh_parse_catches_the_issue(tmp_path):
    """`zsh -f -i -n` refuses what the issue saw: an apostrophe in an own-line comment opens a
    quote. Cheap (~10 ms)."""
    needs_zsh()
    block = Block(tmp_path, 1, "# the engine's estimate first\npython -m x\n")
    assert "unmatched" in parse_errors(["zsh", "-f", "-i", "-n"], block)
    assert parse_errors(["bash", "-n"], block) is None  # bash reads it as a comment
