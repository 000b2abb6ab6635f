"""Print the README's CI commands as one bash script: the lines of every fenced code block that follows a
``<!-- ci -->`` line, in the order they appear. CI runs exactly what a new user is told to type, so the README
cannot drift from what passes. It fails when no marked block is there or the blocks hold no test command."""

from __future__ import annotations

import sys
from pathlib import Path

MARKER = "<!-- ci -->"


def marked_blocks(text: str) -> list[list[str]]:
    lines = text.splitlines()
    blocks: list[list[str]] = []
    for number, line in enumerate(lines):
        if line.strip() != MARKER:
            continue
        start = number + 1
        if start >= len(lines) or not lines[start].startswith("```"):
            raise SystemExit(f"README.md:{number + 1}: {MARKER} must stand right above a ``` code block")
        end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("```")), None)
        if end is None:
            raise SystemExit(f"README.md:{start + 1}: the code block under {MARKER} is never closed")
        blocks.append(lines[start + 1:end])
    return blocks


def main() -> int:
    path = Path(sys.argv[1] if len(sys.argv) > 1 else "README.md")
    blocks = marked_blocks(path.read_text(encoding="utf-8"))
    commands = [line for block in blocks for line in block]
    if not any(line.split("#")[0].split()[:1] == ["pytest"] for line in commands):
        raise SystemExit(f"{path}: no code block marked {MARKER} holds the test command (pytest)")
    print("\n".join(commands))
    return 0


if __name__ == "__main__":
    sys.exit(main())
