"""Head-level policies (razorattention, duoattention): each checked against a plain loop written from its paper's
definition, the cache holding fewer entries on streaming heads, RazorAttention calibrating once per model, and
DuoAttention's pattern errors in one line."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvbench.engine import models
from kvbench.engine.models import load_model
from kvbench.errors import KvbenchError
from kvbench.policies import build_policy
from kvbench.policies import razorattention as razor
from tests.conftest import random_ids
from tests.helpers import assert_model_close, assert_rejected_in_one_line, model_tolerance, run_session

PATTERN = Path(__file__).with_name("data") / "tiny-llama-pattern.tsv"  # random:tiny-llama: 2 layers x 2 KV heads


def expected_masks(retrieval: torch.Tensor, seen: int, budget: int, sinks: int) -> list[torch.Tensor]:
    """By definition: a retrieval head holds every position seen, a streaming head the first `sinks` and the last
    `budget - sinks`."""
    positions = torch.arange(seen)
    streaming = (positions < sinks) | (positions >= seen - (budget - sinks))
    return [torch.stack([torch.ones(seen, dtype=torch.bool) if full else streaming for full in layer.tolist()])
            for layer in retrieval]


def test_duoattention_keeps_everything_on_its_pattern_s_retrieval_heads_and_a_window_on_the_others(tiny_llama):
    # gates 0.9 0.1 / 0.2 0.7: half the heads retrieve, the two highest gates
    policy = build_policy("duoattention", {"pattern": str(PATTERN), "sinks": 4, "head_ratio": 0.5})
    retrieval = torch.tensor([[True, False], [False, True]])
    prompt, decode, budget = random_ids(90), random_ids(6, seed=1), 20
    _, history = run_session(tiny_llama, policy, prompt, decode, budget)
    for step, masks in enumerate(history):  # after the prompt, then after each generated token
        for ours, expected in zip(masks, expected_masks(retrieval, 90 + step, budget, 4), strict=True):
            assert torch.equal(ours, expected), step


def test_duoattention_head_ratio_takes_the_highest_gates_over_the_whole_model(tiny_llama):
    ranked = {0.25: [[True, False], [False, False]], 0.75: [[True, False], [True, True]], 1.0: [[True] * 2] * 2}
    for ratio, retrieval in ranked.items():
        policy = build_policy("duoattention", {"pattern": str(PATTERN), "sinks": 2, "head_ratio": ratio})
        _, history = run_session(tiny_llama, policy, random_ids(60), [], 12)
        expected = expected_masks(torch.tensor(retrieval), 60, 12, 2)
        assert all(torch.equal(o, e) for o, e in zip(history[0], expected, strict=True)), ratio


def test_streaming_heads_really_hold_fewer_entries(tiny_llama, tmp_path):
    pattern = tmp_path / "pattern.tsv"
    pattern.write_text("0.9\t0.8\n0.1\t0.2\n")  # layer 0 retrieves, layer 1 streams
    policy = build_policy("duoattention", {"pattern": str(pattern), "sinks": 4, "head_ratio": 0.5})
    session, _ = run_session(tiny_llama, policy, random_ids(120), random_ids(3, seed=2), 16)
    full, streaming = session.cache.layers
    assert full.live_entries() == 2 * 123 and streaming.live_entries() == 2 * 16
    assert streaming.capacity < 64  # its buffer shrank: the bytes are gone, not masked
    stats = session.cache.stats()
    assert stats.kv_bytes_live == (2 * 123 + 2 * 16) * full.entry_bytes()
    assert stats.cache_ratio == pytest.approx((123 + 16) / (2 * 123))


def reference_head_scores(tokens: int) -> razor.HeadScores:
    """Echo and induction scores from the eager attention weights of `tokens` random ids (seed 0) fed twice: per
    query head, query i of the second copy's attention to key i - tokens (echo) and i - tokens + 1 (induction),
    averaged over those queries; a KV head takes its query heads' maximum."""
    lm = load_model("random:tiny-llama", dtype="float32", device="cpu")  # the `tiny_llama` fixture's weights
    lm.model.set_attn_implementation("eager")
    sequence = torch.randint(0, lm.model.config.vocab_size, (tokens,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        attentions = lm.model(input_ids=torch.cat([sequence, sequence])[None], output_attentions=True).attentions
    echo, induction = [], []
    for weights in attentions:  # [1, heads, n, n]
        heads = weights.shape[1]
        group = heads // lm.kv_heads
        layer_echo, layer_induction = torch.zeros(heads), torch.zeros(heads)
        for head in range(heads):
            for i in range(tokens, 2 * tokens):
                layer_echo[head] += weights[0, head, i, i - tokens] / tokens
                layer_induction[head] += weights[0, head, i, i - tokens + 1] / tokens
        echo.append(layer_echo.view(lm.kv_heads, group).amax(-1))
        induction.append(layer_induction.view(lm.kv_heads, group).amax(-1))
    return razor.HeadScores(torch.stack(echo), torch.stack(induction))


def test_razorattention_scores_are_echo_and_induction_attention_of_a_repeated_random_sequence(tiny_llama):
    ours, reference = razor.calibrate(tiny_llama, 40), reference_head_scores(40)
    assert_model_close(tiny_llama, ours.echo, reference.echo)  # shares of attention: at most 1
    assert_model_close(tiny_llama, ours.induction, reference.induction)
    assert (ours.echo - ours.induction).abs().max() > 10 * model_tolerance(tiny_llama, ours.induction)


def test_razorattention_keeps_its_top_induction_and_echo_heads_whole(tiny_llama, tmp_path, monkeypatch):
    monkeypatch.setenv("KVBENCH_CACHE", str(tmp_path))
    scores = reference_head_scores(40)
    # 4 KV heads: a quarter by induction and a quarter by echo (one head each, the same head or two)
    retrieval = torch.zeros(4, dtype=torch.bool)
    retrieval[scores.induction.flatten().argmax()] = retrieval[scores.echo.flatten().argmax()] = True
    policy = build_policy("razorattention", {"induction": 0.25, "echo": 0.25, "calibration_tokens": 40, "sinks": 2})
    _, history = run_session(tiny_llama, policy, random_ids(70), random_ids(4, seed=3), 16)
    for step, masks in enumerate(history):
        expected = expected_masks(retrieval.view(2, 2), 70 + step, 16, 2)
        assert all(torch.equal(o, e) for o, e in zip(masks, expected, strict=True)), step


def test_razorattention_calibrates_a_model_once_then_reads_its_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KVBENCH_CACHE", str(tmp_path))
    lm = load_model("random:tiny-llama", dtype="float32", device="cpu", seed=5)  # a model no other test calibrated
    forwards = []
    lm.model.register_forward_pre_hook(lambda module, args: forwards.append(1))
    spec = {"calibration_tokens": 32, "sinks": 2}

    def run() -> float:
        forwards.clear()
        policy = build_policy("razorattention", spec)
        run_session(lm, policy, random_ids(50), [], 16)
        return policy.report()["calibration_s"]

    assert run() > 0 and len(forwards) == 2  # the calibration, then the prompt
    assert run() == 0 and len(forwards) == 1  # in memory
    assert len(list((tmp_path / "razorattention").glob("*.pt"))) == 1
    models._PER_MODEL.clear()  # a new process: from disk
    assert run() == 0 and len(forwards) == 1
    other = load_model("random:tiny-llama", dtype="float32", device="cpu", seed=6)  # other weights, same config
    assert models.model_digest(other) != models.model_digest(lm)


def test_duoattention_pattern_errors_are_one_line_naming_the_file(tiny_llama, tmp_path):
    ragged, text, wrong_shape = tmp_path / "ragged.tsv", tmp_path / "text.tsv", tmp_path / "three_layers.tsv"
    ragged.write_text("0.1\t0.2\n0.3\n")
    text.write_text("retrieval\tstreaming\n")
    wrong_shape.write_text("0.1\t0.2\n0.3\t0.4\n0.5\t0.6\n")
    for pattern in (tmp_path / "missing.tsv", ragged, text, tmp_path):  # tmp_path: a folder without the file
        with pytest.raises(KvbenchError) as error:
            build_policy("duoattention", {"pattern": str(pattern)})
        assert len(str(error.value).splitlines()) == 1 and str(pattern) in str(error.value)
    with pytest.raises(KvbenchError, match="pattern") as error:
        build_policy("duoattention", {})
    policy = build_policy("duoattention", {"pattern": str(wrong_shape), "sinks": 2})
    with pytest.raises(KvbenchError) as error:
        run_session(tiny_llama, policy, random_ids(30), [], 8)
    message = str(error.value)
    assert len(message.splitlines()) == 1 and str(wrong_shape) in message and "3 layers" in message


def test_a_pattern_folder_reads_its_full_attention_heads_tsv(tmp_path):
    (tmp_path / "full_attention_heads.tsv").write_text(PATTERN.read_text())
    policy = build_policy("duoattention", {"pattern": str(tmp_path)})
    assert policy.retrieval_heads().tolist() == [[True, False], [False, True]]


@pytest.mark.parametrize("name, params", [("duoattention", {"pattern": str(PATTERN), "sinks": 4}),
                                          ("razorattention", {"calibration_tokens": 32, "sinks": 4})])
def test_a_chunked_prompt_keeps_what_a_whole_one_does(tiny_llama, tmp_path, monkeypatch, name, params):
    """Which heads retrieve is known before the first chunk (RazorAttention calibrates when the session is made)."""
    monkeypatch.setenv("KVBENCH_CACHE", str(tmp_path))
    prompt, decode = random_ids(100, seed=7), random_ids(3, seed=8)
    _, whole = run_session(tiny_llama, build_policy(name, params), prompt, decode, 20)
    _, chunked = run_session(tiny_llama, build_policy(name, params), prompt, decode, 20, chunk=32)
    for ours, theirs in zip(whole[-1], chunked[-1], strict=True):
        assert torch.equal(ours, theirs)
    assert any(bool(mask.all(-1).any()) for mask in whole[-1])  # some head kept everything


def test_a_sweep_with_a_missing_pattern_is_rejected_in_one_line(tmp_path):
    config = tmp_path / "duo.yaml"
    missing = tmp_path / "no_such_pattern.tsv"
    config.write_text(f"""name: duo
model: {{id: "random:tiny-llama", dtype: float32, device: cpu}}
policies: [{{name: duoattention, pattern: {missing}}}]
budgets: [24]
context_lengths: [64]
tasks: [{{name: niah}}]
samples: 1
""")
    assert_rejected_in_one_line(config, str(missing), tmp_path / "run")
