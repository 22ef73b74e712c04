"""Q-Filters: `kvbench calibrate` computes what the paper's SVD of the model's post-RoPE queries gives, saves it as
kvpress's QFilters, deterministically for a seed; the `qfilter` policy keeps what its plain reference keeps, and a
broken artifact (a flipped sign, shuffled layers) fails the comparison with a calibration recomputed here."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from transformers import DynamicCache
from typer.testing import CliRunner

from kvbench.calibration.calibrate import (
    Settings,
    calibrate,
    corpus_documents,
    default_folder,
    load_qfilters,
    qfilters,
    save_qfilters,
)
from kvbench.checks import suite as check
from kvbench.cli import app
from kvbench.errors import KvbenchError
from kvbench.policies import build_policy
from kvbench.policies.reference import qfilter_kept, stock_forward
from tests.conftest import random_ids
from tests.helpers import run_session
from tests.test_kvpress_policies import QueryTap, rope

PROMPT, BUDGET = random_ids(96, seed=31), 40
SETTINGS = Settings(documents=2, tokens=48, samples=10_000)  # every query of both documents


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """Two documents of text and a few tokens more (one byte a token on the random models): both are used."""
    path = tmp_path_factory.mktemp("corpus") / "two.txt"
    path.write_text(("The quick brown fox jumps over the lazy dog; seven wizards hex jovial mice. " * 3)
                    [: 2 * SETTINGS.tokens + 8])
    return path


@pytest.fixture(scope="module")
def calibrated(sharp_llama, corpus, tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("qfilter") / "tiny"
    calibrate(sharp_llama, "qfilter", str(corpus), SETTINGS, folder)
    return folder


@torch.no_grad()
def svd_filters(lm, documents: list[list[int]]) -> torch.Tensor:
    """`[layers, kv_heads, D]` from the definition: every post-RoPE query (q_proj, then RoPE by hand) of the
    documents; per query head the first right singular vector v, negated where most queries project on it
    positively (kvpress scores -<filter, key>), averaged over each KV head's query heads."""
    tap = QueryTap(lm)
    try:
        for ids in documents:
            stock_forward(lm, DynamicCache(), ids, 0)
    finally:
        tap.close()
    layers = []
    for layer in range(lm.num_layers):
        queries = torch.cat([rope(lm, q, 0) for q in tap.queries[layer]], dim=1)  # [H, n, D], float64
        per_head = []
        for head in range(queries.shape[0]):
            direction = torch.linalg.svd(queries[head], full_matrices=False)[2][0]
            majority = (queries[head] @ direction > 0).double().mean() > 0.5
            per_head.append(-direction if majority else direction)
        layers.append(torch.stack(per_head).view(lm.kv_heads, -1, lm.head_dim).mean(dim=1))
    return torch.stack(layers).float()


@pytest.fixture(scope="module")
def expected_filters(sharp_llama, corpus) -> torch.Tensor:
    return svd_filters(sharp_llama, corpus_documents(sharp_llama, str(corpus), SETTINGS, "qfilter"))


def broken(filters: torch.Tensor, how: str) -> torch.Tensor:
    return -filters if how == "sign" else filters.flip(0)  # the layers in reverse order


def test_calibration_is_the_svd_of_the_models_queries_in_kvpress_format(calibrated, expected_filters):
    torch.testing.assert_close(load_qfilters(calibrated), expected_filters, atol=1e-4, rtol=1e-3)
    assert json.loads((calibrated / "config.json").read_text()) == {"kv_head_dim": 16, "num_kv_heads": 2,
                                                                    "num_layers": 2}
    assert json.loads((calibrated / "calibration.json").read_text())["documents"] == 2


@pytest.mark.parametrize("how", ["sign", "layers"])
def test_a_broken_artifact_fails_the_comparison(calibrated, expected_filters, how):
    with pytest.raises(AssertionError):
        torch.testing.assert_close(broken(load_qfilters(calibrated), how), expected_filters, atol=1e-4, rtol=1e-3)


def test_qfilter_keeps_the_keys_along_the_queries_direction(sharp_llama, calibrated, expected_filters):
    policy = build_policy("qfilter", {"filters": str(calibrated)})
    _, history = run_session(sharp_llama, policy, PROMPT, [], BUDGET)
    expected, _ = qfilter_kept(sharp_llama, PROMPT, BUDGET, expected_filters)
    assert all(torch.equal(mine, theirs) for mine, theirs in zip(history[0], expected[0], strict=True))
    # what `kvbench check` compares: the policy's own reference, on the artifact it reads
    checked, _ = policy.reference(sharp_llama, PROMPT, [], BUDGET)
    assert all(torch.equal(mine, theirs) for mine, theirs in zip(history[0], checked[0], strict=True))


@pytest.mark.parametrize("how", ["sign", "layers"])
def test_a_broken_artifact_keeps_other_entries(sharp_llama, calibrated, expected_filters, tmp_path, how):
    save_qfilters(broken(load_qfilters(calibrated), how), tmp_path, {})
    _, history = run_session(sharp_llama, build_policy("qfilter", {"filters": str(tmp_path)}), PROMPT, [], BUDGET)
    expected, _ = qfilter_kept(sharp_llama, PROMPT, BUDGET, expected_filters)
    assert not all(torch.equal(mine, theirs) for mine, theirs in zip(history[0], expected[0], strict=True))


def test_the_calibration_is_deterministic_for_a_seed(sharp_llama, corpus):
    sampled = Settings(documents=2, tokens=48, samples=40)
    documents = corpus_documents(sharp_llama, str(corpus), sampled, "qfilter")

    def run(seed: int) -> torch.Tensor:
        settings = Settings(documents=2, tokens=48, samples=40, seed=seed)
        return qfilters(sharp_llama, documents, settings, lambda done, total: None)

    assert torch.equal(run(0), run(0))
    assert not torch.equal(run(0), run(1))


def test_a_missing_artifact_names_the_command_that_makes_it(sharp_llama, monkeypatch, tmp_path):
    monkeypatch.setenv("KVBENCH_CACHE", str(tmp_path))
    with pytest.raises(KvbenchError, match=r"^policy 'qfilter': no Q-Filters in .*: make them with `kvbench "
                                           r"calibrate -m random:tiny-llama --method qfilter --dtype float32`$"):
        run_session(sharp_llama, build_policy("qfilter"), PROMPT, [], BUDGET)
    save_qfilters(torch.zeros(3, 2, 16), tmp_path / "other", {})
    with pytest.raises(KvbenchError, match="KV heads, head_dim"):  # another model's filters
        run_session(sharp_llama, build_policy("qfilter", {"filters": str(tmp_path / "other")}), PROMPT, [], BUDGET)



def test_an_artifact_of_another_calibration_format_names_the_command_that_remakes_it(sharp_llama, calibrated,
                                                                                    tmp_path):
    """A folder kvbench wrote in another format (its calibration.json says) is refused; one that names no format (as
    kvpress writes it) is read."""
    stale = tmp_path / "stale"
    shutil.copytree(calibrated, stale)
    provenance = json.loads((stale / "calibration.json").read_text())
    (stale / "calibration.json").write_text(json.dumps({**provenance, "calibration_format": 0}))
    policy = build_policy("qfilter", {"filters": str(stale)})
    with pytest.raises(KvbenchError, match=r"^policy 'qfilter': the Q-Filters in .*stale come from calibration "
                                           r"format 0, this kvbench's is 1: make them again with `kvbench calibrate "
                                           r"-m random:tiny-llama --method qfilter --dtype float32 -o .*stale`$"):
        run_session(sharp_llama, policy, PROMPT, [], BUDGET)
    (stale / "calibration.json").write_text("{not json")
    with pytest.raises(KvbenchError, match=r"^.*stale/calibration.json: not a readable JSON file"):
        run_session(sharp_llama, policy, PROMPT, [], BUDGET)
    (stale / "calibration.json").unlink()
    run_session(sharp_llama, policy, PROMPT, [], BUDGET)

def test_kvbench_calibrate_writes_where_the_policy_looks(monkeypatch, tmp_path, corpus):
    monkeypatch.setenv("KVBENCH_CACHE", str(tmp_path))
    arguments = ["calibrate", "-m", "random:tiny-llama", "--method", "qfilter", "--corpus", str(corpus),
                 "--documents", "2", "--tokens", "48"]
    first = CliRunner().invoke(app, arguments)
    assert first.exit_code == 0, first.output
    assert "from 2 documents of 48 tokens" in first.output and " s: " in first.output
    again = CliRunner().invoke(app, arguments)
    assert "read back from the per-model cache" in again.output
    bad = CliRunner().invoke(app, ["calibrate", "-m", "random:tiny-llama", "--method", "kvzap"])
    assert bad.exit_code == 2 and "not one of qfilter, kvzap-linear" in bad.output
    from kvbench.engine.models import load_model

    lm = load_model("random:tiny-llama", dtype="float32", device="cpu")
    run_session(lm, build_policy("qfilter"), PROMPT, [], BUDGET)  # finds the model's own folder


def test_kvbench_check_holds_qfilter_to_its_reference_once_calibrated(sharp_llama, calibrated, monkeypatch, tmp_path):
    monkeypatch.setenv("KVBENCH_CACHE", str(tmp_path))
    prompt, decode = check.prompt_tokens(sharp_llama, 100)[:96], []
    skipped = check.check_policy(sharp_llama, "qfilter", prompt, decode, "short")
    assert skipped.status == "skip" and "kvbench calibrate -m random:tiny-llama --method qfilter" in skipped.detail
    save_qfilters(load_qfilters(calibrated), default_folder(sharp_llama, "qfilter"), {})
    checked = check.check_policy(sharp_llama, "qfilter", prompt, decode, "short")
    assert checked.status == "pass", checked.detail
