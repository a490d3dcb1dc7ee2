"""The one Markdown table writer of the tools (profile, bench-kernels, report)."""

from __future__ import annotations

from collections.abc import Callable, Sequence


def markdown_table(rows, columns: Sequence[str] | None = None,
                   headers: Sequence[str] | None = None, cell: Callable[[object], str] = str) -> str:
    """A GitHub Markdown table of `rows` (dicts, or a pandas DataFrame).

    `columns` picks and orders the keys (default: every key, in first-seen
    order), `headers` names them, `cell` formats one value; ``|`` in a value is
    escaped so it cannot split a cell.
    """
    if hasattr(rows, "iterrows"):  # a DataFrame
        columns = list(columns if columns is not None else rows.columns)
        records = [dict(r) for _, r in rows.iterrows()]
    else:
        records = list(rows)
        if columns is None:
            columns = []
            for r in records:
                columns += [k for k in r if k not in columns]
    headers = list(headers or columns)
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    for r in records:
        lines.append("| " + " | ".join(cell(r.get(c, "")).replace("|", "\\|") for c in columns) + " |")
    return "\n".join(lines)
