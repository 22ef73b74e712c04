"""The building blocks of kvbench's offline HTML pages: the page itself, sortable tables and their cells, collapsible
sections and embedded figures."""

from __future__ import annotations

import base64
import html
import io
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pandas as pd

from kvbench.analysis.columns import Display

PARAMS_SHOWN = 24  # characters of a policy's parameters shown in a table; the rest on hover


STYLE = """
body{font-family:system-ui,sans-serif;margin:1em auto;padding:0 1em;max-width:1360px;color:#222;line-height:1.4}
h1{font-size:1.5em;margin:0.2em 0}h2{font-size:1.2em;margin:0.8em 0 0.4em}h3{font-size:1em;margin:0.6em 0 0.2em}
.facts{color:#555;margin:0 0 0.6em}.note{color:#555;font-size:13px}
.answer{display:grid;grid-template-columns:minmax(0,5fr) minmax(0,6fr);gap:1.5em;align-items:start}
.answer ul{margin:0.2em 0;padding-left:1.2em}.answer li{margin:0.25em 0}
@media (max-width:900px){.answer{grid-template-columns:minmax(0,1fr)}}
.figures{display:grid;grid-template-columns:repeat(auto-fill,minmax(560px,1fr));gap:1em}
figure{margin:0}figure img{max-width:100%;border:1px solid #eee}figcaption{font-size:12px;color:#555}
details{margin:0.4em 0;border:1px solid #ddd;border-radius:4px;padding:0.3em 0.6em}
summary{cursor:pointer;font-weight:600}details[open] summary{margin-bottom:0.4em}
table{border-collapse:collapse;font-size:13px;margin:0.4em 0}
td,th{border:1px solid #ddd;padding:3px 7px;text-align:right;vertical-align:top}
td.text,th.text{text-align:left}th{background:#f3f3f3;cursor:pointer;user-select:none;white-space:nowrap}
th[data-order=asc]::after{content:" \\25B2"}th[data-order=desc]::after{content:" \\25BC"}
tbody tr:nth-child(even){background:#fafafa}mark{background:#ffe066;padding:0 1px}
.departure{color:#D55E00;font-weight:700}span[title]{text-decoration:underline dotted}
"""


# click a heading to sort by it (again: the other way); numbers by data-sort, text as text, blanks last
SORT_SCRIPT = """
for (const table of document.querySelectorAll("table.sortable")) {
  for (const heading of table.tHead.rows[0].cells) {
    heading.addEventListener("click", () => {
      const ascending = heading.dataset.order !== "asc", column = heading.cellIndex;
      for (const other of heading.parentNode.cells) delete other.dataset.order;
      heading.dataset.order = ascending ? "asc" : "desc";
      const key = row => row.cells[column].dataset.sort ?? row.cells[column].textContent.trim();
      const rows = [...table.tBodies[0].rows].sort((a, b) => {
        const x = key(a), y = key(b);
        if (x === "" || y === "") return (x === "") - (y === "");
        const order = isNaN(x) || isNaN(y) ? x.localeCompare(y, undefined, {numeric: true}) : x - y;
        return ascending ? order : -order;
      });
      table.tBodies[0].append(...rows);
    });
  }
}
"""


def embed(drawn: dict[str, Any]) -> list[tuple[str, str]]:
    """(name, base64 PNG) per figure, each closed once drawn: the page carries its images as data: URIs."""
    from kvbench.analysis.plot import _pyplot

    plt = _pyplot()
    images = []
    for name, drawing in drawn.items():
        buffer = io.BytesIO()
        drawing.savefig(buffer, format="png", bbox_inches="tight")
        plt.close(drawing)
        images.append((name, base64.b64encode(buffer.getvalue()).decode()))
    return images


def figure(name: str, data: str) -> str:
    label = html.escape(name)
    return f"<figure><img alt='{label}' src='data:image/png;base64,{data}'><figcaption>{label}</figcaption></figure>"


def page(title: str, body: list[str]) -> str:
    return "\n".join(["<!doctype html><html lang='en'><head><meta charset='utf-8'>",
                      f"<title>{html.escape(title)}</title><style>{STYLE}</style></head><body>", *body,
                      f"<script>{SORT_SCRIPT}</script></body></html>"])


def details(summary: str, content: str, open_: bool = False) -> str:
    return f"<details{' open' if open_ else ''}><summary>{html.escape(summary)}</summary>{content}</details>"


@dataclass(frozen=True)
class Column:
    """A table column: its heading, the summary.csv column it comes from (the heading's hover text), the cell's
    HTML from a row, the value it sorts by (None: the cell's text), and whether it reads as text (left-aligned)."""

    title: str
    source: str
    show: Callable[[dict[str, Any]], str]
    sort: Callable[[dict[str, Any]], Any] | None = None
    text: bool = True


def table(rows: list[dict[str, Any]], columns: list[Column]) -> str:
    """A sortable table (see SORT_SCRIPT); "(none)" for no rows."""
    if not rows:
        return "<p>(none)</p>"

    def align(column: Column) -> str:
        return " class='text'" if column.text else ""

    head = "".join(f"<th{align(c)}{_title(c.source)}>{html.escape(c.title)}</th>" for c in columns)
    body = []
    for row in rows:
        cells = []
        for column in columns:
            sort = "" if column.sort is None else f" data-sort='{_sort_value(column.sort(row))}'"
            cells.append(f"<td{align(column)}{sort}>{column.show(row)}</td>")
        body.append("<tr>" + "".join(cells) + "</tr>")
    return f"<table class='sortable'><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"


def _title(source: str) -> str:
    return f" title='summary.csv: {html.escape(source)}'" if source else ""


def _sort_value(value: Any) -> str:
    return "" if value is None or (isinstance(value, float) and pd.isna(value)) else html.escape(str(value))


def missing(value: Any) -> bool:
    return value is None or (not isinstance(value, (list, dict, str)) and pd.isna(value))


def text(key: str) -> Callable[[dict[str, Any]], str]:
    return lambda row: "" if missing(row.get(key)) else html.escape(str(row[key]))


def raw(key: str) -> Callable[[dict[str, Any]], Any]:
    return lambda row: row.get(key)


def formatted(key: str, form: Callable[[Any], str]) -> Callable[[dict[str, Any]], str]:
    return lambda row: "" if missing(row.get(key)) else html.escape(form(row[key]))


def short(text: str, frame: str = "{}") -> str:
    """Parameters cut to PARAMS_SHOWN characters, all of them on hover."""
    shown = text if len(text) <= PARAMS_SHOWN else text[:PARAMS_SHOWN - 1] + "…"
    hover = f" title='{html.escape(text)}'" if shown != text else ""
    return f"<span{hover}>{html.escape(frame.format(shown))}</span>"


def duration(seconds: float) -> str:
    """`57.7 ms`, `4.73 s`"""
    return Display("", "duration").text(seconds)


def with_ci(key: str, low: str, high: str, spec: str) -> Callable[[dict[str, Any]], str]:
    """`0.33 [0.00, 0.67]`"""
    def show(row: dict[str, Any]) -> str:
        if missing(row.get(key)):
            return ""
        return f"{row[key]:{spec}} [{row[low]:{spec}}, {row[high]:{spec}}]"
    return show
