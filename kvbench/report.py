"""What a run means: the sweet spot per task and length (`recommend`), LaTeX tables, and one
self-contained HTML report with the figures embedded."""

from __future__ import annotations

import base64
import html
import io
from pathlib import Path
from typing import Any

import pandas as pd

from kvbench.results import RunFolder
from kvbench.summary import summarize

GROUP = ["task", "context_length", "question", "prefill"]


def recommend(frame: pd.DataFrame, max_drop: float, max_kl: float | None = None) -> pd.DataFrame:
    """Per group, the cell with the smallest cache ratio whose paired change vs `full` stays within
    `max_drop` points even at the low end of its 95% CI (and, with `max_kl`, whose mean KL from the full cache
    stays within it: only cells that measured fidelity qualify); what it saves and what it costs in speed."""
    rows = []
    for key, group in frame.groupby(GROUP, sort=False):
        full = group[group["policy"] == "full"]
        row: dict[str, Any] = dict(zip(GROUP, key, strict=True))
        if full.empty:
            rows.append({**row, "policy": None, "note": "no full cell to compare with"})
            continue
        higher = bool(group["higher_is_better"].all())
        # the worst end of the change's CI, in points of improvement (see gate.improvement)
        worst = group["delta_ci_low"] * 100 if higher else -group["delta_ci_high"] / full.iloc[0]["score"] * 100
        ok = group[(group["policy"] != "full") & (worst >= -max_drop)]
        if max_kl is not None:
            ok = ok[ok["kl_mean"] <= max_kl] if "kl_mean" in ok else ok.iloc[0:0]
        if ok.empty:
            within = f"{max_drop:g} points" + ("" if max_kl is None else f" and KL {max_kl:g}")
            rows.append({**row, "policy": None, "note": f"none within {within}"})
            continue
        best = ok.sort_values(["cache_ratio", "score"], ascending=[True, not higher]).iloc[0]
        base = full.iloc[0]
        rows.append({
            **row, "policy": best["policy"], "params": best["params"], "budget": best["budget"],
            "cache_ratio": best["cache_ratio"], "score": best["score"], "full_score": base["score"],
            "delta_ci_low": best["delta_ci_low"], "kv_saved_bytes": base["kv_bytes_live"] - best["kv_bytes_live"],
            "decode_speed_vs_full": best["decode_tok_s"] / base["decode_tok_s"] if base["decode_tok_s"] else None,
            "note": "",
        })
    return pd.DataFrame(rows)


def latex(frame: pd.DataFrame) -> str:
    """booktabs tables, one per group; the best value of each column in bold."""
    columns = [("score", "score", max), ("delta_vs_full", r"$\Delta$ vs full", max),
               ("cache_ratio", "cache ratio", min), ("kv_bytes_peak", "kv peak (MiB)", min),
               ("ttft_s", "TTFT (s)", min), ("tpot_s", "TPOT (ms)", min)]
    scale = {"kv_bytes_peak": 2**-20, "tpot_s": 1000}
    out = []
    for key, group in frame.groupby(GROUP, sort=False):
        flip = {max: min} if not group["higher_is_better"].all() else {}  # perplexity: lower wins
        best = {c: flip.get(pick, pick)(group[c].dropna()) for c, _, pick in columns if group[c].notna().any()}
        lines = [r"\begin{table}[t]", r"\centering", r"\small",
                 r"\begin{tabular}{ll" + "r" * len(columns) + "}", r"\toprule",
                 "policy & budget & " + " & ".join(title for _, title, _ in columns) + r" \\", r"\midrule"]
        for _, row in group.iterrows():
            cells = []
            for column, _, _ in columns:
                value = row[column]
                text = "--" if pd.isna(value) else f"{value * scale.get(column, 1):.2f}"
                cells.append(rf"\textbf{{{text}}}" if column in best and value == best[column] else text)
            name = _tex(row["policy"] + (f" ({row['params']})" if row["params"] else ""))
            lines.append(f"{name} & {_tex(row['budget'])} & " + " & ".join(cells) + r" \\")
        task, length, question, prefill = key
        lines += [r"\bottomrule", r"\end{tabular}",
                  rf"\caption{{{_tex(task)}, {length} tokens, question {question}, prefill {prefill}.}}",
                  r"\end{table}", ""]
        out.append("\n".join(lines))
    return "\n".join(out)


def _tex(text: str) -> str:
    return str(text).replace("\\", r"\textbackslash{}").replace("_", r"\_").replace("%", r"\%").replace("&", r"\&")


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
                         **({"first_divergence": record["first_divergence"]} if "first_divergence" in record
                            else {})})
    return lost[:limit]


def _mark_departure(prediction: str, full: str) -> str:
    """The prediction with `⟦` where it leaves the full cache's (nothing if it never does)."""
    at = next((i for i, (a, b) in enumerate(zip(prediction, full, strict=False)) if a != b),
              None if len(prediction) == len(full) else min(len(prediction), len(full)))
    return prediction if at is None else f"{prediction[:at]}⟦{prediction[at:]}"


def html_report(run: str | Path, max_drop: float = 2.0) -> Path:
    """RUN/report.html: manifest, summary tables, every figure (embedded), recommendations, failures."""
    from kvbench.plot import _pyplot, figures

    plt = _pyplot()
    run = Path(run)
    frame = summarize(run)
    manifest = RunFolder(run).manifest() or {}
    images = []
    for name, figure in figures(run).items():
        buffer = io.BytesIO()
        figure.savefig(buffer, format="png", bbox_inches="tight")
        plt.close(figure)
        images.append((name, base64.b64encode(buffer.getvalue()).decode()))
    env, model = manifest.get("environment", {}), manifest.get("model", {})
    facts = {"run": manifest.get("name"), "model": model.get("spec"), "architecture": model.get("architecture"),
             "layers / KV heads / head dim": "{} / {} / {}".format(*(model.get(k) for k in ("layers", "kv_heads",
                                                                                         "head_dim"))),
             "dtype": model.get("dtype"), "device": f"{env.get('device')} ({env.get('device_name')})",
             "kvbench": env.get("kvbench"), "git commit": env.get("git_commit"), "torch": env.get("torch"),
             "transformers": env.get("transformers"), "python": env.get("python"),
             "started": manifest.get("started"), "finished": manifest.get("finished")}
    shown = ["task", "context_length", "question", "policy", "params", "budget", "n", "score", "score_ci_low",
             "score_ci_high", "delta_vs_full", "cache_ratio", "kv_bytes_peak", "ttft_s", "tpot_s",
             "kl_mean", "top1_agreement", "attn_recall", "length_ratio", "status"]  # fidelity where measured
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'><title>kvbench report</title>",
        "<style>body{font-family:system-ui,sans-serif;margin:2em;max-width:1200px}table{border-collapse:collapse;"
        "font-size:13px;margin-bottom:1.5em}td,th{border:1px solid #ccc;padding:3px 7px;text-align:right}"
        "th{background:#f3f3f3}td:first-child,th:first-child{text-align:left}img{max-width:100%;"
        "border:1px solid #eee;margin:0.5em 0}code{background:#f5f5f5}</style></head><body>",
        f"<h1>kvbench report: {html.escape(str(manifest.get('name', run.name)))}</h1>",
        "<h2>Run</h2>", _table(pd.DataFrame(list(facts.items()), columns=["", ""])),
        f"<h2>Recommendation (max drop {max_drop:g} points, CI low end)</h2>",
        _table(recommend(frame, max_drop).fillna({"policy": "-"})),
        "<h2>Summary</h2>", _table(frame[[c for c in shown if c in frame]].assign(
            kv_bytes_peak=frame["kv_bytes_peak"] / 2**20).rename(columns={"kv_bytes_peak": "kv_peak_MiB"})),
        "<h2>Figures</h2>",
        *(f"<h3>{html.escape(name)}</h3><img alt='{html.escape(name)}' src='data:image/png;base64,{data}'>"
          for name, data in images),
        "<h2>Failure gallery: samples the full cache got right and a policy lost</h2>",
        _table(pd.DataFrame(failure_gallery(run))),
        "</body></html>",
    ]
    path = run / "report.html"
    path.write_text("\n".join(parts), encoding="utf-8")
    return path


def _table(frame: pd.DataFrame) -> str:
    if frame.empty:
        return "<p>(none)</p>"
    return frame.to_html(index=False, na_rep="", float_format=lambda v: f"{v:.3g}", escape=True, border=0)
