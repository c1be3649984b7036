"""docs/ARCHITECTURE.md's room tables say how many modules each folder holds and how many lines:
they must say what the tree holds (the module counts exactly, the lines within 10 %).
``python tests/test_doc_tables.py`` rewrites them from the tree."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ROW = re.compile(r"^\| `([\w/.]+)` \| (\d+) \| ([\d,]+) \|$", re.M)


def modules_and_lines(path: str) -> tuple[int, int]:
    """A module's (1, its lines), or a folder's modules (not its ``__init__.py``, not its
    sub-folders) and their lines."""
    target = ROOT / path
    files = [target] if target.is_file() else [f for f in target.glob("*.py") if f.name != "__init__.py"]
    return len(files), sum(len(f.read_text().splitlines()) for f in files)


def test_the_room_tables_count_what_the_tree_holds() -> None:
    rows = ROW.findall((ROOT / "docs" / "ARCHITECTURE.md").read_text())
    assert len(rows) >= 15  # both tables were read
    wrong = []
    for path, modules, lines in rows:
        have_modules, have_lines = modules_and_lines(path)
        said = int(lines.replace(",", ""))
        if have_modules != int(modules) or abs(have_lines - said) > 0.1 * have_lines:
            wrong.append(
                f"{path}: says {modules} modules, {said:,} lines; holds {have_modules}, {have_lines:,}"
            )
    assert not wrong, "update docs/ARCHITECTURE.md's room tables:\n" + "\n".join(wrong)


if __name__ == "__main__":  # python tests/test_doc_tables.py: rewrite the tables from the tree
    page = ROOT / "docs" / "ARCHITECTURE.md"

    def counted(m: re.Match) -> str:
        modules, lines = modules_and_lines(m.group(1))
        return f"| `{m.group(1)}` | {modules} | {lines:,} |"

    page.write_text(ROW.sub(counted, page.read_text()))
