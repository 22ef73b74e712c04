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
from kvbench.summary import MODEL_AXES, model_facets, summarize

GROUP = [*MODEL_AXES, "task", "context_length", "question", "prefill"]


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
        worst = worst_change(group, full.iloc[0]["score"])
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


def worst_change(cells: pd.DataFrame, full_score: float) -> pd.Series:
    """Each cell's paired change against `full` at the worst end of its 95% CI, in points of improvement (a
    fraction's points, or percent of full's perplexity where lower is better; see gate.improvement)."""
    higher = cells["higher_is_better"].astype(bool)
    return (cells["delta_ci_low"] * 100).where(higher, -cells["delta_ci_high"] / full_score * 100)


SETTING = ["policy", "params", "budget"]


def scenario_advice(frame: pd.DataFrame, max_drop: float) -> pd.DataFrame:
    """Per scenario (the workload its tasks stand for, see Task.scenario): the policy setting (policy, params,
    budget) with the smallest mean cache ratio whose paired change against `full` stays within `max_drop` points
    at the low end of its 95% CI on *every* task, length and question placement of the scenario; what it scores
    there against full, its worst change, and the bytes it keeps. Settings that failed anywhere do not qualify."""
    if "scenario" not in frame:
        return pd.DataFrame()
    rows = []
    for scenario, part in frame[frame["scenario"].notna()].groupby("scenario", sort=False):
        row: dict[str, Any] = {"scenario": scenario, "tasks": ", ".join(sorted(part["task"].unique()))}
        fulls = part[(part["policy"] == "full") & part["score"].notna()]
        groups = {key: full for key, full in fulls.groupby(GROUP, sort=False)}
        if not groups:
            rows.append({**row, "policy": None, "note": "no full cell to compare with"})
            continue
        candidates = []
        for setting, cells in part[part["policy"] != "full"].groupby(SETTING, sort=False, dropna=False):
            cells = cells.set_index(GROUP)
            if not all(key in cells.index and pd.notna(cells.loc[[key]]["score"]).all() for key in groups):
                continue
            worst = min(float(worst_change(cells.loc[[key]], groups[key].iloc[0]["score"]).min()) for key in groups)
            candidates.append((setting, worst, cells.loc[list(groups)]))
        passing = [c for c in candidates if c[1] >= -max_drop]
        if not passing:
            best = max(candidates, key=lambda c: c[1], default=None)
            note = f"none within {max_drop:g} points" + (
                "" if best is None else f"; closest: {_setting(best[0])} ({best[1]:+.1f})")
            rows.append({**row, "policy": None, "note": note})
            continue
        setting, worst, cells = min(passing, key=lambda c: (c[2]["cache_ratio"].mean(), -c[1]))
        rows.append({**row, **dict(zip(SETTING, setting, strict=True)), "cache_ratio": cells["cache_ratio"].mean(),
                     "score": cells["score"].mean(), "full_score": fulls["score"].mean(), "worst_change": worst,
                     "note": ""})
    return pd.DataFrame(rows)


def advice_lines(advice: pd.DataFrame, max_drop: float) -> list[str]:
    """The per-scenario recommendation as sentences (the report opens with them)."""
    lines = []
    for row in advice.to_dict("records"):
        head = f"{row['scenario']} ({row['tasks']})"
        if row.get("policy") is None or pd.isna(row.get("policy")):
            lines.append(f"{head}: {row['note']}; keep the full cache.")
            continue
        lines.append(f"{head}: {_setting((row['policy'], row['params'], row['budget']))} scores {row['score']:.3g} "
                     f"where full scores {row['full_score']:.3g} (worst paired change {row['worst_change']:+.1f} "
                     f"points at the CI's low end, within {max_drop:g}) in {row['cache_ratio']:.2f} of the KV bytes.")
    return lines


def _setting(setting: tuple[str, str, str]) -> str:
    """`snapkv(window=32) at 0.25` (summary rows hold params as text and budget as text, "-" for none)."""
    policy, params, budget = setting
    return f"{policy}{f'({params})' if params else ''}{'' if budget == '-' else f' at {budget}'}"


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
    env, models = manifest.get("environment", {}), manifest.get("models") or [manifest.get("model", {})]
    model = models[0]
    facts = {"run": manifest.get("name"), "model": ", ".join(str(m.get("spec")) for m in models),
             "architecture": model.get("architecture"),
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
        *_advice_section(frame, max_drop),
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


def _advice_section(frame: pd.DataFrame, max_drop: float) -> list[str]:
    lines = [f"{label}: {line}" if label else line for label, part in model_facets(frame)
             for line in advice_lines(scenario_advice(part, max_drop), max_drop)]
    if not lines:
        return []
    return [f"<h2>What to run, by scenario (max drop {max_drop:g} points on every task of the scenario)</h2><ul>",
            *(f"<li>{html.escape(line)}</li>" for line in lines), "</ul>"]


def _table(frame: pd.DataFrame) -> str:
    if frame.empty:
        return "<p>(none)</p>"
    return frame.to_html(index=False, na_rep="", float_format=lambda v: f"{v:.3g}", escape=True, border=0)
