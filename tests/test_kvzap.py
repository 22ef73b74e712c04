"""KVzap: `kvbench calibrate --method kvzap-linear|kvzap-mlp` fits KVzip+'s own scores from the attention's inputs,
saves kvpress's KVzapModel format and scores itself on held-out text (R^2, kept-set agreement); a broken artifact
(wrong sign, shuffled layers) scores worse; the `kvzap` policy keeps what its plain reference keeps."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from kvbench.calibration import kvzap
from kvbench.calibration.calibrate import calibrate, corpus_documents, default_folder
from kvbench.calibration.methods import Settings
from kvbench.checks import suite as check
from kvbench.cli import app
from kvbench.errors import KvbenchError
from kvbench.policies import build_policy
from kvbench.policies.budgets import Threshold
from kvbench.tasks.corpus import load_corpus
from tests.conftest import random_ids
from tests.helpers import NEEDED_PARAMS, run_session

# distinct tokens: a repeated one has the same first-layer hidden state, so the same prediction (an exact tie)
PROMPT, BUDGET = torch.randperm(256, generator=torch.Generator().manual_seed(31))[:96].tolist(), 40
SETTINGS = Settings(documents=8, tokens=96, samples=96, held_out=2, hidden_dim=32, epochs=30)


@pytest.fixture(scope="module", autouse=True)
def own_cache(tmp_path_factory):
    """Calibrations computed here, never read back from an earlier run's per-model cache (older code's)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("KVBENCH_CACHE", str(tmp_path_factory.mktemp("cache")))
        yield


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """Prose of the embedded corpus, one byte a token on the random models: 12 documents of 96 tokens."""
    path = tmp_path_factory.mktemp("corpus") / "prose.txt"
    path.write_text(load_corpus("embedded")[: 12 * SETTINGS.tokens])
    return path


@pytest.fixture(scope="module")
def calibrated(sharp_llama, corpus, tmp_path_factory) -> dict[str, Path]:
    folders = {}
    for model_type in ("linear", "mlp"):
        folders[model_type] = tmp_path_factory.mktemp("kvzap") / model_type
        calibrate(sharp_llama, f"kvzap-{model_type}", str(corpus), SETTINGS, folders[model_type])
    return folders


@pytest.fixture(scope="module")
def held_out(sharp_llama, corpus) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The held-out documents' features and KVzip+ targets, as the calibration scored them."""
    documents = corpus_documents(sharp_llama, str(corpus), SETTINGS, "kvzap-mlp")[-SETTINGS.held_out:]
    return [kvzap.targets(sharp_llama, ids) for ids in documents]


def broken(surrogate: kvzap.Surrogate, how: str) -> kvzap.Surrogate:
    """`surrogate` with its predictions negated (`sign`) or its layers in reverse order (`layers`)."""
    if how == "sign":
        for module in surrogate.layers:
            last = module if surrogate.hidden_dim is None else module[2]
            last.weight.data.neg_()
            last.bias.data.neg_()
    else:
        surrogate.layers = torch.nn.ModuleList(list(surrogate.layers)[::-1])
    return surrogate


@pytest.mark.parametrize("model_type", ["linear", "mlp"])
def test_the_calibration_is_kvpress_s_format_with_its_held_out_scores(calibrated, model_type):
    folder = calibrated[model_type]
    config = json.loads((folder / "config.json").read_text())
    assert config | {"hidden_dim": None} == {"architectures": ["KVzapModel"], "model_type": "kvzap", "input_dim": 64,
                                             "output_dim": 2, "hidden_dim": None, "n_modules": 2, "dtype": "float32"}
    assert config["hidden_dim"] == (None if model_type == "linear" else 32)
    names = set(load_file(str(folder / "model.safetensors")))
    parts = ("",) if model_type == "linear" else (".0", ".2")
    assert names == {f"layers.{i}{part}.{kind}" for i in range(2) for part in parts for kind in ("weight", "bias")}
    provenance = json.loads((folder / "calibration.json").read_text())
    # better than the mean (R^2 > 0) and than chance (two random halves agree 1/3 on average)
    assert provenance["held_out_r2"] > 0 and len(provenance["held_out_r2_per_layer"]) == 2
    assert provenance["kept_agreement"] > 0.4 and provenance["kept_agreement_budget"] == 0.5


@pytest.mark.parametrize("model_type", ["linear", "mlp"])
@pytest.mark.parametrize("how", ["sign", "layers"])
def test_a_broken_artifact_predicts_its_targets_worse(calibrated, held_out, model_type, how):
    r2, agreement = kvzap.evaluate(kvzap.load(calibrated[model_type]), held_out)
    provenance = json.loads((calibrated[model_type] / "calibration.json").read_text())
    assert r2.mean().item() == pytest.approx(provenance["held_out_r2"], abs=1e-5)  # the calibration's own scoring
    worse_r2, worse_agreement = kvzap.evaluate(broken(kvzap.load(calibrated[model_type]), how), held_out)
    assert worse_r2.mean() < r2.mean() - 0.05 and worse_agreement < agreement


def test_the_targets_are_kvzip_plus_scores_and_the_ridge_is_scikit_learns(sharp_llama, corpus):
    """The linear surrogate is Ridge(alpha=1) with an intercept, here by least squares on the augmented system
    [X - mean; sqrt(alpha) I] W = [y - mean; 0], from every position of two documents with a recorded target."""
    settings = Settings(documents=2, tokens=96, samples=96)
    documents = corpus_documents(sharp_llama, str(corpus), settings, "kvzap-linear")
    saved = kvzap.fit(sharp_llama, documents, settings, "linear", lambda done, total: None)
    data = [kvzap.targets(sharp_llama, ids) for ids in documents]
    for layer in range(sharp_llama.num_layers):
        x = torch.cat([features[layer] for features, _ in data]).double()
        y = torch.cat([scores[layer] for _, scores in data]).double()
        # a score that underflowed to 0 has no target: on this sharpened random model, about a quarter
        known = torch.isfinite(y).all(dim=-1)
        assert y.shape == (2 * 96, sharp_llama.kv_heads) and known.double().mean() > 0.5
        x, y = x[known], y[known]
        augmented = torch.cat([x - x.mean(0), torch.eye(x.shape[1], dtype=x.dtype) * kvzap.RIDGE_ALPHA ** 0.5])
        target = torch.cat([y - y.mean(0), torch.zeros(x.shape[1], y.shape[1], dtype=y.dtype)])
        weight = torch.linalg.lstsq(augmented, target).solution  # [hidden, kv_heads]
        torch.testing.assert_close(saved[f"weights.layers.{layer}.weight"].double(), weight.T, atol=1e-4, rtol=1e-3)
        torch.testing.assert_close(saved[f"weights.layers.{layer}.bias"].double(), y.mean(0) - x.mean(0) @ weight,
                                   atol=1e-4, rtol=1e-3)


@pytest.mark.parametrize("model_type", ["linear", "mlp"])
def test_kvzap_keeps_what_its_plain_reference_keeps(sharp_llama, calibrated, model_type):
    policy = build_policy("kvzap", {"model_type": model_type, "kvzap_model": str(calibrated[model_type])})
    _, history = run_session(sharp_llama, policy, PROMPT, [], BUDGET)
    expected, _ = policy.reference(sharp_llama, PROMPT, [], BUDGET)
    assert all(torch.equal(mine, theirs) for mine, theirs in zip(history[0], expected[0], strict=True))


def test_a_broken_artifact_keeps_other_entries(sharp_llama, calibrated, tmp_path):
    kvzap.save(broken(kvzap.load(calibrated["linear"]), "layers"), tmp_path, {})
    _, history = run_session(sharp_llama, build_policy("kvzap", {"model_type": "linear", "kvzap_model": str(tmp_path)}),
                             PROMPT, [], BUDGET)
    expected, _ = build_policy("kvzap", {"model_type": "linear", "kvzap_model": str(calibrated["linear"])}).reference(
        sharp_llama, PROMPT, [], BUDGET)
    assert not all(torch.equal(mine, theirs) for mine, theirs in zip(history[0], expected[0], strict=True))


def test_a_missing_artifact_names_the_command_that_makes_it(sharp_llama, monkeypatch, tmp_path):
    monkeypatch.setenv("KVBENCH_CACHE", str(tmp_path))
    with pytest.raises(KvbenchError, match=r"^policy 'kvzap': no KVzap model in .*: make it with `kvbench calibrate "
                                           r"-m random:tiny-llama --method kvzap-mlp --dtype float32`$"):
        run_session(sharp_llama, build_policy("kvzap"), PROMPT, [], BUDGET)
    kvzap.save(kvzap.Surrogate(32, 2, 2, None), tmp_path / "other", {})
    with pytest.raises(KvbenchError, match=r"is for \(2, 32\) \(layers, hidden size\)"):  # another model's
        other = build_policy("kvzap", {"model_type": "linear", "kvzap_model": str(tmp_path / "other")})
        run_session(sharp_llama, other, PROMPT, [], BUDGET)


def test_kvbench_calibrate_reports_the_held_out_scores_and_writes_where_the_policy_looks(monkeypatch, tmp_path,
                                                                                         corpus):
    monkeypatch.setenv("KVBENCH_CACHE", str(tmp_path))
    arguments = ["calibrate", "-m", "random:tiny-llama", "--method", "kvzap-linear", "--corpus", str(corpus),
                 "--documents", "4", "--tokens", "96", "--held-out", "1"]
    result = CliRunner().invoke(app, arguments)
    assert result.exit_code == 0, result.output
    assert "on 1 held-out documents R^2 " in result.output and "kept sets agree" in result.output
    from kvbench.engine.models import load_model

    lm = load_model("random:tiny-llama", dtype="float32", device="cpu")
    run_session(lm, build_policy("kvzap", {"model_type": "linear"}), PROMPT, [], BUDGET)  # finds the model's own
    bad = CliRunner().invoke(app, arguments[:-1] + ["4"])
    assert bad.exit_code == 2 and "held_out must leave a document to train on: 4 of 4" in bad.output


def test_under_a_threshold_decoding_it_holds_the_window_and_what_reaches_the_threshold(sharp_llama):
    """DMSPress(KVzapPress, decoding=True): a token that leaves the window stays only if exp(score) >= t."""
    params, window = {**NEEDED_PARAMS["kvzap"], "window": 8, "decode": True}, 8
    whole, _ = run_session(sharp_llama, build_policy("kvzap", params), PROMPT, [], 10 * len(PROMPT))
    threshold = float(whole.cache.layers[1].slot_stat(whole.policy.state_key).exp().median())  # about half go
    session, _ = run_session(sharp_llama, build_policy("kvzap", params), PROMPT, random_ids(24, seed=2),
                             Threshold(threshold))
    for layer in session.cache.layers:
        real = torch.ones_like(layer.live_positions(), dtype=torch.bool) if layer.padding() is None else \
            ~layer.padding()
        recent = layer.live_positions() >= layer.seen - window
        assert ((recent & real).sum(dim=-1) == window).all()  # the newest `window` tokens, every one
        reached = layer.slot_stat(session.policy.state_key).exp() >= threshold
        assert (reached | recent)[real].all()  # the others reach the threshold
        assert (real.sum(dim=-1) < layer.seen).all()  # and some went


def test_kvbench_check_holds_kvzap_to_its_reference_once_calibrated(sharp_llama, calibrated, monkeypatch, tmp_path):
    monkeypatch.setenv("KVBENCH_CACHE", str(tmp_path))
    prompt = check.prompt_tokens(sharp_llama, 100)[:96]
    skipped = check.check_policy(sharp_llama, "kvzap", prompt, [], "short")
    assert skipped.status == "skip" and "kvbench calibrate -m random:tiny-llama --method kvzap-mlp" in skipped.detail
    kvzap.save(kvzap.load(calibrated["mlp"]), default_folder(sharp_llama, "kvzap-mlp"), {})
    checked = check.check_policy(sharp_llama, "kvzap", prompt, [], "short")
    assert checked.status == "pass", checked.detail
