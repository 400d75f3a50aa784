"""Plain text for the ``vllm-dedup`` command's output: byte sizes and aligned tables."""

from __future__ import annotations

__all__ = ["size_text", "table"]


def size_text(n: float) -> str:
    """``n`` bytes in decimal units: ``"512 B"``, ``"269.0 MB"``, ``"1.4 GB"`` (up to TB)."""
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    raise AssertionError


def table(rows: list[list], header: list[str], align: str | None = None) -> str:
    """``rows`` under ``header``, columns padded to their widest cell, a rule of dashes under
    the header.  ``align``: one letter per column, ``l`` (left) or ``r`` (right); by default
    the first column left, the others right."""
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    align = align or "l" + "r" * (len(header) - 1)

    def line(row: list) -> str:
        cells = (str(c).ljust(w) if a == "l" else str(c).rjust(w) for c, w, a in zip(row, widths, align))
        return "  ".join(cells).rstrip()

    return "\n".join([line(header), line(["-" * w for w in widths]), *map(line, rows)])
