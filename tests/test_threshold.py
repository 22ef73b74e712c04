"""Threshold budgets (`{threshold: t}`): each layer and KV head keeps what its policy's normalised score puts at or
above t, never fewer than the protected entries nor more than the prompt; records, summaries, figures, the gate
and the recommendation read the share each sample achieved."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
import torch
from matplotlib.collections import LineCollection
from typer.testing import CliRunner

from kvbench.analysis.gate import Limits, gate, make_baseline
from kvbench.analysis.plot import figures
from kvbench.analysis.report import recommend
from kvbench.analysis.summary import summarize
from kvbench.cli import app
from kvbench.config.cells import expand
from kvbench.config.schema import load_config
from kvbench.errors import KvbenchError
from kvbench.policies import POLICIES, build_policy
from kvbench.policies.budgets import Threshold
from kvbench.runs.run_folder import RunFolder
from tests.conftest import random_ids
from tests.helpers import NEEDED_PARAMS, assert_model_close, assert_rejected_in_one_line, run_session
from tests.test_sweep import sweep, write_config

PROMPT = random_ids(96, seed=3)
TAKERS = {"snapkv": {"window": 8}, "expected_attention": {}, "knorm": {}, "keydiff": {}, "h2o": {}, "tova": {},
          "kvzap": {**NEEDED_PARAMS["kvzap"], "window": 8},
          "expected_attention_stats": NEEDED_PARAMS["expected_attention_stats"]}


def test_the_policies_that_take_a_threshold_are_the_scoring_ones():
    assert sorted(n for n in POLICIES.names() if POLICIES.get(n).threshold_scale) == sorted(TAKERS)


def share(weights: torch.Tensor) -> torch.Tensor:
    """Each finite weight over its head's finite total; +inf (protected) stays."""
    finite = torch.isfinite(weights)
    return torch.where(finite, weights / torch.where(finite, weights, 0).sum(dim=-1, keepdim=True), weights)


def reference_scores(lm, name: str) -> list[torch.Tensor]:
    """Per layer `[kv_heads, n]`, in position order: the policy's normalised score of every prompt entry, written
    from its definition (docs/running.md#threshold-budgets) on a cache whose budget exceeds the prompt (it gathers
    the same statistics and evicts nothing)."""
    policy = build_policy(name, TAKERS[name])
    n = len(PROMPT)
    session, _ = run_session(lm, policy, PROMPT, [], budget=10 * n)
    scores = []
    for layer in session.cache.layers:
        positions = layer.live_positions()[0]
        keys = layer.live_keys()[0].float()
        if name == "snapkv":  # its eviction score (the observation window +inf)
            score = policy.score(layer, 10 * n)[0]
        elif name == "kvzap":  # exp of the predicted log score (the plain loop's), the newest window +inf
            predicted = policy.reference(lm, PROMPT, [], n)[1]
            assert predicted is not None
            score = predicted[layer.layer_idx].exp().masked_fill(positions >= n - TAKERS[name]["window"], float("inf"))
        elif name in ("expected_attention", "expected_attention_stats"):  # a share of its score (the sinks +inf)
            score = share(policy.score(layer, 10 * n)[0])
        elif name == "tova":  # the newest query's attention weight, as observed
            score = layer.slot_stat(policy.state_key)[0]
        elif name == "h2o":  # the attention received over the queries since the entry arrived
            score = layer.slot_stat(policy.state_key)[0] / (n - positions)
        elif name == "knorm":
            score = share(1 / keys.norm(dim=-1))
        else:  # keydiff
            mean_unit = torch.nn.functional.normalize(keys, dim=-1).mean(dim=1, keepdim=True)
            score = share(1 - torch.nn.functional.cosine_similarity(keys, mean_unit, dim=-1))
        scores.append(score.gather(-1, positions.argsort(dim=-1)))
    return scores


@pytest.mark.parametrize("name", sorted(TAKERS))
def test_each_head_keeps_what_reaches_the_threshold(sharp_llama, name):
    scores = reference_scores(sharp_llama, name)
    # about half of each head goes: halfway between the two middle scores, so no score sits within rounding of it
    values = torch.cat([s[torch.isfinite(s)] for s in scores]).unique()
    threshold = float(values[len(values) // 2 - 1 : len(values) // 2 + 1].mean())
    session, history = run_session(sharp_llama, build_policy(name, TAKERS[name]), PROMPT, [], Threshold(threshold))
    counts = set()
    for layer, (kept, score) in enumerate(zip(history[0], scores, strict=True)):
        assert torch.equal(kept, score >= threshold), f"{name} layer {layer}"
        counts |= set(kept.sum(dim=-1).tolist())
    assert len(counts) > 1, "the heads keep different counts"
    stats = session.cache.stats()
    assert stats.kv_bytes_physical < 0.8 * stats.kv_bytes_full  # the buffers shrank, not only a mask


def test_never_below_the_protected_entries(sharp_llama):
    policy = build_policy("snapkv", {"window": 8})
    _, history = run_session(sharp_llama, policy, PROMPT, [], Threshold(0.999))
    window = torch.arange(len(PROMPT)) >= len(PROMPT) - 8
    for kept in history[0]:
        assert torch.equal(kept, window.expand_as(kept))
    _, history = run_session(sharp_llama, build_policy("expected_attention"), PROMPT, [], Threshold(0.999))
    sinks = torch.arange(len(PROMPT)) < 4
    for kept in history[0]:
        assert torch.equal(kept, sinks.expand_as(kept))


@pytest.mark.parametrize("name", ["snapkv", "knorm", "tova"])
def test_never_above_the_prompt(sharp_llama, name):
    session, history = run_session(sharp_llama, build_policy(name, TAKERS[name]), PROMPT, random_ids(3, seed=4),
                                   Threshold(1e-12))
    assert all(kept.all() for kept in history[0])
    assert session.cache.evictions == 0 and session.cache.stats().cache_ratio == 1.0
    assert session.cache.layer_ratios() == [1.0] * sharp_llama.num_layers


def test_a_threshold_that_keeps_everything_generates_as_the_full_cache(sharp_llama):
    from kvbench.engine.generation import generate
    from kvbench.engine.settings import RunSettings

    question, settings = random_ids(4, seed=7), RunSettings(budget=Threshold(1e-12))
    full = generate(sharp_llama, build_policy("full"), PROMPT, question, RunSettings(), 6, eos_token_ids=set())
    kept_all = generate(sharp_llama, build_policy("snapkv", {"window": 8}), PROMPT, question, settings, 6,
                        eos_token_ids=set())
    # the same entries; a per-head store masks its (empty) padding, a path that may round differently
    assert kept_all.tokens == full.tokens
    assert_model_close(sharp_llama, kept_all.last_logits, full.last_logits)


def test_a_decode_time_policy_applies_it_while_decoding(sharp_llama):
    """TOVA evicts every `evict_every` tokens as it does under a token budget: each time, what the newest query
    attends to below the threshold leaves, whatever the count."""
    session, history = run_session(sharp_llama, build_policy("tova"), PROMPT, random_ids(8, seed=5), Threshold(0.02),
                                   evict_every=4)
    held = [int(masks[0][0].sum()) for masks in history]  # layer 0, head 0
    assert held[0] < len(PROMPT) and held[4] < held[3]  # the 4th token evicted; the ones before only grew
    assert held[1:4] == [held[0] + 1, held[0] + 2, held[0] + 3]


def test_later_compressions_never_keep_the_padding_of_uneven_heads(sharp_llama):
    """After the prompt, heads hold different counts (the shorter padded); each decode step's threshold keeps only
    real entries: the new token or ones held before, each once."""
    policy = build_policy("knorm", {"decode": True})
    session, history = run_session(sharp_llama, policy, PROMPT, random_ids(6, seed=6), Threshold(1 / len(PROMPT)))
    assert len({int(c) for c in history[0][0].sum(dim=-1)}) > 1, "uneven heads"
    for step, (before, after) in enumerate(zip(history, history[1:], strict=False)):
        for layer, (held, kept) in enumerate(zip(before, after, strict=True)):
            new = torch.zeros_like(kept)
            new[:, -1] = True
            assert not (kept & ~torch.cat([held, torch.zeros_like(held[:, :1])], dim=-1) & ~new).any(), (step, layer)
    for layer, kept in zip(session.cache.layers, history[-1], strict=True):
        assert layer.live_entries() == int(kept.sum())  # no slot holds a position twice


def test_a_batch_of_rows_is_refused_by_the_cache(tiny_llama):
    from kvbench.engine.session import Session
    from kvbench.engine.settings import RunSettings

    with pytest.raises(KvbenchError, match="one sequence at a time"):
        Session(tiny_llama, build_policy("knorm"), RunSettings(budget=Threshold(0.01)), prompt_tokens=[8, 8],
                left_padding=torch.tensor([0, 0]))


# --- a sweep of threshold cells ---------------------------------------------------------------------------------

SWEEP = {
    "name": "threshold",
    "model": {"id": "random:tiny-llama", "dtype": "float32", "device": "cpu"},
    "policies": ["full", {"name": "snapkv", "window": 8}, "knorm"],
    "budgets": [0.5, {"threshold": 0.002}, "threshold=0.5"],
    "context_lengths": [300],
    "tasks": [{"name": "niah", "depths": [0.2, 0.8]}],
    "samples": 2,
    "max_new_tokens": 3,
    "batch_size": 2,
}


@pytest.fixture(scope="module")
def threshold_run(tmp_path_factory):
    folder = tmp_path_factory.mktemp("threshold")
    run = folder / "run"
    sweep(write_config(folder, SWEEP), run)
    return run


def test_records_carry_the_threshold_and_the_achieved_ratios(threshold_run):
    records = [r for r in RunFolder(threshold_run).records() if isinstance(r["cell"]["budget"], dict)]
    assert len(records) == 2 * 2 * 4  # two policies, two thresholds, four samples
    for record in records:
        assert record["budget"] == record["cell"]["budget"] == {"threshold": record["threshold"]}
        assert len(record["layer_ratios"]) == 2 and all(0 < r <= 1 for r in record["layer_ratios"])
        # every layer saw every token: the whole cache's ratio is the layers' mean
        assert record["cache_ratio"] == pytest.approx(np.mean(record["layer_ratios"]))
        assert record["batch_size"] == 1  # each sample alone: its own count
    snapkv = {r["threshold"]: r["cache_ratio"] for r in records if r["policy"]["name"] == "snapkv"}
    assert snapkv[0.5] < snapkv[0.002]
    manifest = json.loads((threshold_run / "manifest.json").read_text())
    assert any("threshold" in line for line in manifest["batching"]["fallback"])
    token_budget = [r for r in RunFolder(threshold_run).records() if r["cell"]["budget"] == 0.5]
    assert token_budget and all("threshold" not in r and "layer_ratios" not in r for r in token_budget)


def test_the_summary_places_threshold_cells_at_their_achieved_ratio(threshold_run):
    frame = summarize(threshold_run, write=False)
    cells = frame[frame["threshold"].notna()]
    assert sorted(cells["budget"].unique()) == ["threshold=0.002", "threshold=0.5"]
    records = pd.DataFrame(RunFolder(threshold_run).records())
    for _, row in cells.iterrows():
        ratios = records.loc[records["cell_id"] == row["cell_id"], "cache_ratio"]
        assert row["cache_ratio"] == pytest.approx(ratios.mean())
        assert (row["cache_ratio_min"], row["cache_ratio_max"]) == (ratios.min(), ratios.max())
    assert frame.loc[frame["threshold"].isna() & (frame["policy"] != "full"), "budget"].eq("0.5").all()
    summarize(threshold_run)
    markdown = (threshold_run / "summary.md").read_text()
    assert "| snapkv | window=8 | threshold=0.5 |" in markdown


def test_the_figure_draws_threshold_points_at_their_achieved_ratio_with_its_spread(threshold_run):
    frame = summarize(threshold_run, write=False)
    figure = figures(threshold_run)["score_vs_ratio_niah"]
    axis = figure.axes[0]
    for policy, params in (("snapkv", "window=8"), ("knorm", "")):
        cells = frame[(frame["policy"] == policy) & frame["threshold"].notna()].sort_values("cache_ratio")
        label = f"{policy} ({params}) [threshold]" if params else f"{policy} [threshold]"
        line, = [line for line in axis.get_lines() if line.get_label() == label]
        assert np.allclose(line.get_xdata(), cells["cache_ratio"])
        # the x error bars: one horizontal segment per point, from the samples' least ratio to their most
        spans = {tuple(np.round([*segment[:, 0], segment[0, 1]], 9)) for bar in axis.collections
                 if isinstance(bar, LineCollection) for segment in bar.get_segments()}
        for _, cell in cells.iterrows():
            assert tuple(np.round([cell["cache_ratio_min"], cell["cache_ratio_max"], cell["score"]], 9)) in spans
    texts = {text.get_text() for text in axis.texts}
    assert {"t=0.5", "t=0.002"} <= texts


def test_recommend_can_pick_a_threshold_cell_by_its_achieved_ratio(threshold_run):
    frame = summarize(threshold_run, write=False)
    picked = recommend(frame, max_drop=100).iloc[0]
    smallest = frame[frame["policy"] != "full"].sort_values("cache_ratio").iloc[0]
    assert smallest["budget"] == "threshold=0.5"  # keeping only snapkv's window: the least of all
    assert (picked["budget"], picked["cache_ratio"]) == (smallest["budget"], smallest["cache_ratio"])


def test_the_gate_matches_a_threshold_cell_to_its_baseline_by_threshold(threshold_run, tmp_path):
    baseline = make_baseline(threshold_run, tmp_path / "baseline.json")
    checks = {c.label: c for c in gate(threshold_run, baseline, Limits())}
    frame = summarize(threshold_run, write=False)
    for _, cell in frame[frame["threshold"].notna()].iterrows():
        params = "(window=8)" if cell["policy"] == "snapkv" else ""
        check = checks[f"niah L=300 aware {cell['policy']}{params} b={cell['budget']}"]
        assert check.verdict == "pass" and check.cell_id == cell["cell_id"]
        assert check.score == (pytest.approx(cell["score"]), pytest.approx(cell["score"]))


# --- errors: one line naming the culprit --------------------------------------------------------------------------

@pytest.mark.parametrize(("budget", "culprit"), [
    ({"threshold": 0}, "threshold must be a number in (0, 1)"), ({"threshold": 1.5}, "threshold must be"),
    ({"threshold": "high"}, "threshold must be"), ("threshold=x", "threshold=x"),
    ({"thresold": 0.1}, "'threshold'"),
])
def test_a_bad_threshold_is_one_line_naming_it(tmp_path, budget, culprit):
    config = write_config(tmp_path, {**SWEEP, "budgets": [budget]})
    assert_rejected_in_one_line(config, culprit, tmp_path / "run")
    with pytest.raises(KvbenchError, match="budgets"):
        load_config(config)


@pytest.mark.parametrize("policy", ["window", "streaming_llm", "pyramidkv", "ada_kv", "chunkkv", "random"])
def test_a_policy_that_cannot_take_a_threshold_is_named(tmp_path, policy):
    config = write_config(tmp_path, {**SWEEP, "policies": ["full", policy], "budgets": [{"threshold": 0.01}]})
    assert_rejected_in_one_line(config, f"policy '{policy}' takes no threshold budget", tmp_path / "run")


def test_full_and_storage_policies_run_once_beside_threshold_cells(tmp_path):
    """They keep every token and get no budget cell (as with any budget), so there is nothing to refuse."""
    config = write_config(tmp_path, {**SWEEP, "policies": ["full", "quant", "knorm"], "budgets": [{"threshold": 0.01}]})
    budgets = {cell.description["policy"]["name"]: cell.description["budget"] for cell in expand(load_config(config))}
    assert budgets == {"full": None, "quant": None, "knorm": {"threshold": 0.01}}


def test_the_run_command_takes_a_threshold_and_refuses_it_where_it_cannot_be(tmp_path):
    runner = CliRunner()
    result = runner.invoke(app, ["run", "-m", "random:tiny-llama", "--dtype", "float32", "--device", "cpu",
                                 "-p", "window", "-b", "threshold=0.01", "-c", "64"])
    assert result.exit_code == 2 and "policy 'window' takes no threshold budget" in result.output
    assert len(result.output.strip().splitlines()) == 1
    result = runner.invoke(app, ["estimate", "random:tiny-llama", "-c", "64", "-b", "threshold=0.01"])
    assert result.exit_code == 2 and "threshold" in result.output and len(result.output.strip().splitlines()) == 1
    result = runner.invoke(app, ["run", "-m", "random:tiny-llama", "--dtype", "float32", "--device", "cpu",
                                 "-p", "knorm", "-b", "threshold=0.01", "-c", "300", "--max-new-tokens", "2", "--json"])
    assert result.exit_code == 0, result.output
    full, knorm = (json.loads(line) for line in result.output.strip().splitlines()[-2:])
    assert knorm["budget"] == {"threshold": 0.01} and knorm["threshold"] == 0.01 and knorm["layer_ratios"]
    assert full["policy"]["name"] == "full" and full["budget"] is None and "threshold" not in full
