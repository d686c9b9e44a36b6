"""Report templates as data: a benchmark's Markdown is a tuple of `Section`s rendered by `render`.

A section names the context key it needs (absent or empty: the section is left
out), a title and blocks: `Text` (a paragraph template), `Pairs` (a two-column
table of label and value templates), `Table` (column heads and one cell
template per column, one row per dict of a context list), `Code` (a fenced
block of lines) and `Raw` (Markdown already made, e.g. the header table).

Templates are `str.format` strings over the context, with `report.fmt` as the
default format of every field (3 significant digits, `-` for None) and a few
named formats in `FORMATS` (`{x:ms}` seconds shown as ms, `{x:pct}`, ...).
A missing key or index renders as `-` rather than failing, as the old
hand-written reports did with `.get`. A benchmark's report module keeps only
the arithmetic (`context(data)`: rows, ratios, labels); the words are data.
"""

from __future__ import annotations

import string
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvdir.report import fmt, table


def _scaled(factor: float) -> Callable[[Any], str]:
    return lambda v: fmt(None if v is None else v * factor)


FORMATS: dict[str, Callable[[Any], str]] = {
    "": fmt,
    "ms": _scaled(1e3),
    "mib": lambda v: f"{v / 2**20:.0f}",
    "pct": lambda v: f"{v:.0%}",
    "x": lambda v: f"{fmt(v)}x",
    "pairs": lambda d: ", ".join(f"{k} {v:.1f}" for k, v in d.items()),
    "slash": lambda xs: "/".join(str(x) for x in xs),
}
"""Named field formats; any other spec goes to the built-in `format` (`,`, `.1f`)."""


class _Formatter(string.Formatter):
    def get_field(self, field_name: str, args: Sequence[Any], kwargs: Mapping[str, Any]) -> Any:
        try:
            return super().get_field(field_name, args, kwargs)
        except (KeyError, IndexError, TypeError, AttributeError):
            return None, field_name

    def format_field(self, value: Any, format_spec: str) -> str:
        named = FORMATS.get(format_spec)
        if named is not None:
            return named(value)
        if value is None:
            return "-"
        return format(value, format_spec)


_FORMATTER = _Formatter()


def fill(template: str, ctx: Mapping[str, Any]) -> str:
    return _FORMATTER.vformat(template, (), ctx)


@dataclass(frozen=True, slots=True)
class Text:
    template: str


@dataclass(frozen=True, slots=True)
class Pairs:
    rows: tuple[tuple[str, str], ...]


@dataclass(frozen=True, slots=True)
class Table:
    head: tuple[str, ...]
    cells: tuple[str, ...]
    rows: str
    """The context key of the list of row dicts (each row's keys shadow the context's)."""


@dataclass(frozen=True, slots=True)
class Code:
    lines: str
    """The context key of the lines; nothing is written where they are empty."""
    lead: str = ""


@dataclass(frozen=True, slots=True)
class Raw:
    key: str


Block = Text | Pairs | Table | Code | Raw


@dataclass(frozen=True, slots=True)
class Section:
    needs: str
    """The context key that must be present and non-empty for the section to be written."""
    title: str | None
    blocks: tuple[Block, ...]


def text_and_table(
    needs: str, title: str | None, text: str, head: tuple[str, ...], cells: tuple[str, ...]
) -> Section:
    """The common section: a paragraph, then a table of the rows under `needs`."""
    return Section(needs, title, (Text(text), Table(head, cells, needs)))


def _block(b: Block, ctx: Mapping[str, Any]) -> list[str]:
    if isinstance(b, Text):
        return [fill(b.template, ctx), ""]
    if isinstance(b, Pairs):
        rows = [(fill(k, ctx), fill(v, ctx)) for k, v in b.rows]
        return [table(rows, ["", ""]), ""]
    if isinstance(b, Table):
        cells = [[fill(c, {**ctx, **row}) for c in b.cells] for row in ctx[b.rows]]
        return [table(cells, b.head), ""]
    if isinstance(b, Code):
        lines = ctx.get(b.lines)
        if not lines:
            return []
        return [*([b.lead, ""] if b.lead else []), "```", *lines, "```", ""]
    return [ctx[b.key], ""]


def render(title: str, sections: Sequence[Section], ctx: Mapping[str, Any]) -> str:
    """The report: `# title`, then every section whose `needs` key is set in `ctx`."""
    parts = [fill(title, ctx), ""]
    for s in sections:
        if not ctx.get(s.needs):
            continue
        if s.title is not None:
            parts += [f"## {fill(s.title, ctx)}", ""]
        for b in s.blocks:
            parts += _block(b, ctx)
    return "\n".join(parts)


__all__ = [
    "FORMATS",
    "Block",
    "Code",
    "Pairs",
    "Raw",
    "Section",
    "Table",
    "Text",
    "fill",
    "render",
    "text_and_table",
]
