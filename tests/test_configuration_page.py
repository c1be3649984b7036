"""docs/configuration.md is generated from the settings classes (`relaygr settings`): the committed
page equals what the command prints, every setting has a row with its meaning, and a stale or
missing page is an error of `relaygr settings --check`."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from relaygr.tools.settings_doc import SETTINGS_CLASSES, add_arguments, run, settings_page

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "configuration.md"


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


def test_the_committed_page_is_what_the_settings_generate() -> None:
    assert PAGE.read_text() == settings_page(), "regenerate: relaygr settings > docs/configuration.md"


def test_every_setting_has_a_row_with_its_meaning() -> None:
    page = settings_page()
    for _, cls, _ in SETTINGS_CLASSES:
        for name, field in cls.model_fields.items():
            assert field.description, f"{cls.__name__}.{name} has no description for the page"
            assert f"| `RELAYGR_{name.upper()}` |" in page


def test_defaults_are_rules_not_this_machines_paths() -> None:
    page = settings_page()
    assert str(Path.home()) not in page
    assert "| `RELAYGR_MODEL_DIR` | `$RELAYGR_HOME/model` |" in page


def test_check_accepts_the_page_and_refuses_a_stale_or_missing_one(tmp_path, capsys) -> None:
    assert run(_args("--check", str(PAGE))) == 0
    stale = tmp_path / "configuration.md"
    stale.write_text(settings_page().replace("RELAYGR_BUDGET_MS", "RELAYGR_BUDGET"))
    assert run(_args("--check", str(stale))) == 1
    assert "differs from the settings" in capsys.readouterr().err
    assert run(_args("--check", str(tmp_path / "absent.md"))) == 2
    assert "cannot read" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [[], ["--check", str(PAGE)]])
def test_the_command_parses(argv: list[str]) -> None:
    assert _args(*argv).check == (Path(argv[1]) if argv else None)
