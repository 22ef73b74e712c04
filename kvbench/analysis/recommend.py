"""Which policy setting to run: per task and length the smallest cache within a drop of `full`'s score
(`recommend`), and per scenario the one setting that holds on all of its tasks (`scenario_advice`)."""

from __future__ import annotations

from typing import Any

import pandas as pd

from kvbench.analysis.columns import view
from kvbench.analysis.summary import MODEL_AXES

GROUP = [*MODEL_AXES, "task", "context_length", "question", "prefill"]
SHOWN_LOSSES = 4  # the sub-scores a reason names at most, the largest drops first


def recommend(frame: pd.DataFrame, max_drop: float, max_kl: float | None = None) -> pd.DataFrame:
    """Per group, the cell with the smallest cache ratio whose paired change vs `full` stays within
    `max_drop` points even at the low end of its 95% CI (and, with `max_kl`, whose mean KL from the full cache
    stays within it: only cells that measured fidelity qualify); what it saves, what it costs in speed, and what its
    mean hides (`hidden_costs`)."""
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
            within = tolerance(max_drop, higher) + ("" if max_kl is None else f" and KL {max_kl:g}")
            rows.append({**row, "policy": None, "note": f"none within {within}{_closest(group, worst, higher)}"})
            continue
        best = ok.sort_values(["cache_ratio", "score"], ascending=[True, not higher]).iloc[0]
        base = full.iloc[0]
        # a batch's tokens/s and times measure the batch: compared only between cells of one batch size
        alike = _batch(best) == _batch(base)
        rows.append({
            **row, "policy": best["policy"], "params": best["params"], "budget": best["budget"],
            "cache_ratio": best["cache_ratio"], "score": best["score"], "full_score": base["score"],
            "delta_ci_low": best["delta_ci_low"], "kv_saved_bytes": base["kv_bytes_live"] - best["kv_bytes_live"],
            "decode_speed_vs_full": best["decode_tok_s"] / base["decode_tok_s"] if alike and base["decode_tok_s"]
            else None,
            "delta_vs_full": best["delta_vs_full"], "delta_ci_high": best["delta_ci_high"],
            "tpot_s": best["tpot_s"], "full_tpot_s": base["tpot_s"] if alike else None, "higher_is_better": higher,
            "batch_size": _batch(best), "hidden": "; ".join(hidden_costs(best, base, higher)),
            "note": "" if alike else f"speed not compared: batch size {_batch(best)}, full's {_batch(base)}",
        })
    return pd.DataFrame(rows)


def _closest(group: pd.DataFrame, worst: pd.Series, higher_is_better: bool) -> str:
    """`; closest: snapkv at 0.5 (-50.0), beneath its mean: rule_1 0 (full 1)` for a group no cell passes."""
    changes = worst[group["policy"] != "full"].dropna()
    if changes.empty:
        return ""
    cell, full = group.loc[changes.idxmax()], group[group["policy"] == "full"].iloc[0]
    hidden = "; ".join(hidden_costs(cell, full, higher_is_better))
    return f"; closest: {_setting((cell['policy'], cell['params'], cell['budget']))} ({changes.max():+.1f})" + (
        f", beneath its mean: {hidden}" if hidden else "")


def hidden_costs(cell: pd.Series, full: pd.Series, higher_is_better: bool) -> list[str]:
    """Where a cell within the drop on its mean still fares worse than `full` on the same samples: the sub-scores it
    loses (`rule_2`, an instruction's position; a RULER subtask), the largest drops first, then the reason columns
    (columns.VIEWS["reason"]: examples or rules split, the system prompt leaked, answers much longer or shorter)."""
    losses = []
    for name in cell.index:
        if not name.startswith("score_") or name in ("score_ci_low", "score_ci_high"):
            continue
        mine, theirs = cell[name], full.get(name)
        drop = (theirs - mine) if higher_is_better else (mine - theirs)
        if pd.notna(drop) and drop > 0:
            losses.append((-drop, f"{name.removeprefix('score_')} {mine:.2g} (full {theirs:.2g})"))
    reasons = [text for _, text in sorted(losses)[:SHOWN_LOSSES]]
    if len(losses) > SHOWN_LOSSES:
        reasons.append(f"{len(losses) - SHOWN_LOSSES} more sub-scores below full's")
    for column, display in view("reason"):
        mine, theirs = cell.get(column.name), full.get(column.name)
        if mine is None or pd.isna(mine) or mine == 0 or (pd.notna(theirs) and mine <= theirs):
            continue
        reasons.append(f"{display.text(mine)} {display.heading}" + (
            "" if theirs is None or pd.isna(theirs) or theirs == 0 else f" (full {display.text(theirs)})"))
    return reasons


def _batch(row: pd.Series) -> int:
    """A summary row's batch size (one for runs from before batching)."""
    size = row.get("batch_size")
    return 1 if size is None or pd.isna(size) else int(size)


def tolerance(max_drop: float, higher_is_better: bool) -> str:
    """`--max-drop` in the unit `worst_change` measures it in: points of a score, or percent of full's value where
    lower is better (perplexity)."""
    return f"{max_drop:g} points" if higher_is_better else f"{max_drop:g}% of full's value"


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
