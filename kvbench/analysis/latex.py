"""LaTeX tables of a summary: booktabs, one per group, the best value of each column in bold."""

from __future__ import annotations

import pandas as pd

from kvbench.analysis.columns import view
from kvbench.analysis.recommend import GROUP
from kvbench.analysis.summary import MODEL_AXES


def latex(frame: pd.DataFrame) -> str:
    """booktabs tables, one per group; the best value of each column in bold."""
    columns = [(c.name, d, max if c.better == "higher" else min) for c, d in view("latex")]
    out = []
    for key, group in frame.groupby(GROUP, sort=False):
        flip = {max: min} if not group["higher_is_better"].all() else {}  # perplexity: lower wins
        best = {c: flip.get(pick, pick)(group[c].dropna()) for c, _, pick in columns if group[c].notna().any()}
        lines = [r"\begin{table}[t]", r"\centering", r"\small",
                 r"\begin{tabular}{ll" + "r" * len(columns) + "}", r"\toprule",
                 "policy & budget & " + " & ".join(d.heading for _, d, _ in columns) + r" \\", r"\midrule"]
        for _, row in group.iterrows():
            cells = []
            for column, display, _ in columns:
                value = row[column]
                text = "--" if pd.isna(value) else display.text(value)
                cells.append(rf"\textbf{{{text}}}" if column in best and value == best[column] else text)
            name = _tex(row["policy"] + (f" ({row['params']})" if row["params"] else ""))
            lines.append(f"{name} & {_tex(row['budget'])} & " + " & ".join(cells) + r" \\")
        model, dtype, task, length, question, prefill = key
        several = frame[MODEL_AXES].drop_duplicates().shape[0] > 1  # name the model only when the run has several
        where = f"{_tex(model)} ({dtype}), " if several else ""
        lines += [r"\bottomrule", r"\end{tabular}",
                  rf"\caption{{{where}{_tex(task)}, {length} tokens, question {question}, prefill {prefill}.}}",
                  r"\end{table}", ""]
        out.append("\n".join(lines))
    return "\n".join(out)


def _tex(text: str) -> str:
    return str(text).replace("\\", r"\textbackslash{}").replace("_", r"\_").replace("%", r"\%").replace("&", r"\&")
