"""The generated pages are fresh: what `make docs` would write now is what is committed."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from tailserve import configdoc
from tailserve.cli import build_parser
from tailserve.cli_flags import cli_fields, flag_name
from tailserve.config import EngineArgs
from tailserve.server.settings import ServerSettings

ROOT = Path(__file__).resolve().parents[1]


def test_configuration_page_is_what_make_docs_writes() -> None:
    committed = (ROOT / configdoc.PAGE).read_text(encoding="utf-8")
    assert committed == configdoc.render(), "docs/configuration.md is stale: run `make docs`"


def test_configuration_check_mode_says_stale(tmp_path: Path) -> None:
    page = tmp_path / "configuration.md"
    page.write_text("old\n", encoding="utf-8")
    assert configdoc.main([str(page), "--check"]) == 1
    assert configdoc.main([str(page)]) == 0
    assert configdoc.main([str(page), "--check"]) == 0
    assert page.read_text(encoding="utf-8") == configdoc.render()


def _serve_options() -> set[str]:
    """The long options `tailserve serve --help` shows (a boolean's --no-x is its --x)."""
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    assert isinstance(sub.choices, dict)
    serve = sub.choices["serve"]
    return {o for a in serve._actions if a.help != argparse.SUPPRESS for o in a.option_strings
            if o.startswith("--") and not o.startswith("--no-") and o != "--help"}


def test_configuration_page_lists_every_serve_flag_once() -> None:
    page = configdoc.render()
    listed = re.findall(r"^\| `(--[a-z0-9-]+)` \|", page, flags=re.M)
    assert sorted(listed) == sorted(_serve_options())


def test_fallback_help_only_for_fields_without_their_own() -> None:
    no_help = {flag_name(f) for cls in (EngineArgs, ServerSettings) for f in cli_fields(cls)
               if not f.metadata.get("help")}
    assert set(configdoc.FALLBACK_HELP) <= no_help  # an entry whose field has help: remove it
    assert no_help - {"model"} <= set(configdoc.FALLBACK_HELP)  # every flag says what it does


def test_format_default() -> None:
    assert configdoc.format_default(None) == "—"
    assert configdoc.format_default(True) == "on"
    assert configdoc.format_default(False) == "off"
    assert configdoc.format_default(2.0) == "`2`"
    assert configdoc.format_default(0.05) == "`0.05`"
    assert configdoc.format_default(float("inf")) == "inf"
    assert configdoc.format_default("auto") == "`auto`"
    assert configdoc.format_default(16) == "`16`"
