"""The failure gallery: samples a policy lost that the full cache kept, its prediction beside full's, and their
HTML with the answer highlighted."""

from __future__ import annotations

import html
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvbench.analysis.html_page import Column, missing, raw, text
from kvbench.runs.run_folder import RunFolder


def failure_gallery(run: str | Path, limit: int = 40) -> list[dict[str, Any]]:
    """Samples where a policy lost points that `full` kept on the same sample: prediction beside reference."""
    records = RunFolder(run).records()
    keep = ("model", "task", "context_length", "question", "prefill", "samples", "seed")
    full = {(repr([r["cell"][k] for k in keep]), r["sample_id"]): r for r in records
            if r["cell"]["policy"]["name"] == "full"}
    lost = []
    for record in records:
        reference = full.get((repr([record["cell"][k] for k in keep]), record["sample_id"]))
        sign = 1 if record.get("higher_is_better", True) else -1
        if reference and record["cell"]["policy"]["name"] != "full" and \
                sign * record["scores"]["score"] < sign * reference["scores"]["score"]:
            lost.append({"policy": record["cell"]["policy"]["name"], "budget": record["cell"]["budget"],
                         "context_length": record["cell"]["context_length"], "sample": record["sample_id"],
                         "prediction": _mark_departure(record["prediction"], reference["prediction"]),
                         "full_prediction": reference["prediction"], "references": record["references"],
                         "context": _context_span(record.get("meta", {})),
                         **({"first_divergence": record["first_divergence"]} if "first_divergence" in record
                            else {})})
    return lost[:limit]


def _context_span(meta: dict[str, Any]) -> str | None:
    """The part of the prompt that holds the answer, where a record keeps it: a needle task's needle sentence, a
    dialogue's stated facts (records keep no whole prompt)."""
    if meta.get("needle"):
        return str(meta["needle"])
    facts = [fact["statement"] for fact in meta.get("facts", []) if isinstance(fact, dict) and "statement" in fact]
    return " ".join(facts) or None


def _mark_departure(prediction: str, full: str) -> str:
    """The prediction with `⟦` where it leaves the full cache's (nothing if it never does)."""
    at = next((i for i, (a, b) in enumerate(zip(prediction, full, strict=False)) if a != b),
              None if len(prediction) == len(full) else min(len(prediction), len(full)))
    return prediction if at is None else f"{prediction[:at]}⟦{prediction[at:]}"


def gallery_columns() -> list[Column]:
    def marked(key: str) -> Callable[[dict[str, Any]], str]:
        return lambda row: "" if missing(row.get(key)) else highlight(str(row[key]), row["references"])

    return [Column("policy", "", text("policy")), Column("budget", "", text("budget")),
            Column("length", "", text("context_length"), raw("context_length"), text=False),
            Column("sample", "", text("sample")),
            Column("answer", "", lambda r: html.escape(" | ".join(map(str, r["references"])))),
            Column("context (where the answer sits)", "", marked("context")),
            Column("prediction", "", marked("prediction")), Column("full's prediction", "", marked("full_prediction"))]


def highlight(text: str, answers: list[str]) -> str:
    """`text` as HTML with each occurrence of a reference answer in <mark> (case-insensitive), and the gallery's
    departure marker `⟦` (see _mark_departure) set off."""
    found = sorted({str(a) for a in answers if str(a).strip()}, key=len, reverse=True)  # the longest match first
    pattern = re.compile("|".join(map(re.escape, found)), re.IGNORECASE) if found else None
    out = []
    for index, piece in enumerate(text.split("⟦")):
        if index:
            out.append("<span class='departure' title='leaves the full cache&#39;s prediction here'>⟦</span>")
        at = 0
        for match in pattern.finditer(piece) if pattern else ():
            out.append(html.escape(piece[at:match.start()]) + f"<mark>{html.escape(match.group())}</mark>")
            at = match.end()
        out.append(html.escape(piece[at:]))
    return "".join(out)
