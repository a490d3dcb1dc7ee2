"""The README's Python example runs as written."""

from __future__ import annotations

from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_python_example_runs(capsys):
    text = README.read_text()
    block = text.split("## Python API", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    exec(compile(block, "README.md", "exec"), {})
    assert "filtered reload" in capsys.readouterr().out  # report.summary() was printed


def test_readme_is_short():
    assert len(README.read_text().splitlines()) <= 200
