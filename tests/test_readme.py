"""The README's Python snippets run as written (against the demo model in a temp HOME)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"


def _snippets() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_has_python_snippets() -> None:
    assert _snippets(), "README.md should show the offline API in a ```python block"


@pytest.mark.parametrize("index", range(len(_snippets())))
def test_readme_snippet_runs(index: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))  # the demo model is written under ~/.cache
    exec(compile(_snippets()[index], f"README.md snippet {index}", "exec"), {})
    assert (tmp_path / ".cache" / "agentgate" / "demo-model" / "config.json").is_file()
