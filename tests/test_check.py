"""`kvbench check` passes where kvbench is right and fails, naming the check, where it is broken on purpose: a
position off by one in `full`, SnapKV's pooling, NVML reading zero."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from typer.testing import CliRunner

import kvbench.policies.snapkv
from kvbench.checks import suite as check
from kvbench.cli import app
from kvbench.engine.models import load_model

pytestmark = pytest.mark.usefixtures("fresh_inductor")  # kvbench check compiles a decode step

SETTINGS = check.CheckSettings(short=64, long=200, new_tokens=6, decode_steps=4)


@pytest.fixture(scope="module")
def gemma3():
    """Sliding layers (window 8) and a global one, one KV head, q/k norms."""
    return load_model("random:tiny-gemma3", dtype="float32", device="cpu")


def statuses(lm, settings=SETTINGS) -> dict[str, str]:
    return {result.name: result.status for result in check.run_checks(lm, settings, lambda _: None)}


def failed(results: dict[str, str]) -> list[str]:
    """The failed checks but `timing`: on a tiny model a decode step is Python overhead, which a loaded machine
    slows unevenly (the timing check is for real models; this suite times nothing)."""
    return sorted(name for name, status in results.items() if status == "fail" and name != "timing")


def test_passes_on_llama_a_sliding_model_and_a_soft_capped_one(sharp_llama, gemma3):
    gemma2 = load_model("random:tiny-gemma2", dtype="float32", device="cpu")
    assert check.reference_kernel(gemma2, "auto") == "eager"  # SDPA cannot cap logits
    for lm in (sharp_llama, gemma3, gemma2):
        settings = SETTINGS if lm is not gemma2 else check.CheckSettings(short=64, long=200, new_tokens=6,
                                                                           decode_steps=4, attention="eager")
        results = statuses(lm, settings)
        assert failed(results) == [], lm.spec
        assert results["policy.snapkv.long"] == results["memory.counted"] == "pass"
    assert statuses(gemma3)["layers"] == "pass"  # 200 tokens pass its window of 8


def test_a_position_off_by_one_fails_generate(sharp_llama, monkeypatch):
    forward = sharp_llama.model.forward

    def shifted(*args, **kwargs):
        if "kv_observer" in kwargs and kwargs["position_ids"].shape[-1] == 1:  # kvbench's decode steps only
            kwargs["position_ids"] = kwargs["position_ids"] + 1
        return forward(*args, **kwargs)

    monkeypatch.setattr(sharp_llama.model, "forward", shifted)
    results = statuses(sharp_llama, check.CheckSettings(short=64, long=200, new_tokens=6, policies=("snapkv",)))
    assert {"generate.short", "generate.long"} <= set(failed(results))


def test_a_broken_pooling_fails_snapkv_only(sharp_llama, monkeypatch):
    def pool_of_three(votes, kernel, stride, padding):
        return F.max_pool1d(votes, 3, stride, 1)

    monkeypatch.setattr(kvbench.policies.snapkv, "F", SimpleNamespace(max_pool1d=pool_of_three,
                                                                      avg_pool1d=F.avg_pool1d))
    # a quarter of 160 tokens is past SnapKV's observation window (32)
    results = statuses(sharp_llama, check.CheckSettings(short=160, long=200, new_tokens=6,
                                                        policies=("snapkv", "h2o")))
    assert failed(results) == ["policy.snapkv.long", "policy.snapkv.short"]


def test_nvml_reading_zero_fails_its_check():
    record = {"mem_peak_alloc": 3 << 30, "mem_peak_device": 0, "mem_baseline": 1 << 30, "kv_bytes_peak": 1 << 30}
    assert check.judge_nvml(record).status == "fail"
    assert check.judge_nvml({**record, "mem_peak_device": 4 << 30}).status == "pass"
    assert check.judge_nvml({**record, "mem_peak_device": None, "mem_device_note": "no NVML"}).status == "fail"
    assert check.judge_allocator(record).status == "pass"
    assert check.judge_allocator({**record, "mem_peak_alloc": record["mem_baseline"]}).status == "fail"


def test_miscounted_bytes_fail():
    assert check.judge_counted({"kv_bytes_physical": 100}, 100).status == "pass"
    assert check.judge_counted({"kv_bytes_physical": 50}, 100).status == "fail"


def test_dtype_check_compares_half_precision_with_float32():
    lm = load_model("random:tiny-llama", dtype="bfloat16", device="cpu", seed=1)
    result = check.check_dtype(lm, check.prompt_tokens(lm, 200), [1, 2, 3])
    assert result.status == "pass", result.detail
    assert set(result.numbers) == {"snapkv", "h2o"}
    assert next(lm.model.parameters()).dtype == torch.bfloat16  # the round trip left the model as it was


def test_ties_count_as_ties_and_a_moved_entry_does_not():
    expected = torch.tensor([[True, True, False, False]])
    scores = [torch.tensor([[3.0, 1.0, 1.0, 0.0]])]
    assert check.agreement([[torch.tensor([[True, False, True, False]])]], [[expected]], scores) == (1.0, 1.0)
    mean, _ = check.agreement([[torch.tensor([[True, False, False, True]])]], [[expected]], scores)
    assert mean == pytest.approx(1 / 3)


def test_cli_report_and_exit_codes(tmp_path):
    report = tmp_path / "check.json"
    result = CliRunner().invoke(app, ["check", "-m", "random:tiny-llama", "--context", "128", "--policies",
                                      "snapkv,streaming_llm", "--no-timing", "--json", "--json-out", str(report)])
    written = json.loads(report.read_text())
    assert json.loads(result.stdout) == written  # --json: stdout holds the report alone, the lines go to stderr
    assert "policy.snapkv.long" in result.stderr
    assert failed({c["name"]: c["status"] for c in written["checks"]}) == [], result.output
    # no speed verdict asked: every check passes or is skipped, timing with its reason
    assert result.exit_code == 0 and written["passed"] and written["settings"]["timing"] is False, result.output
    timing = next(c for c in written["checks"] if c["name"] == "timing")
    assert timing["status"] == "skip" and "--no-timing" in timing["detail"]
    assert written["environment"]["torch"] == torch.__version__
    assert {c["name"] for c in written["checks"]} >= {"generate.short", "policy.snapkv.long", "timing"}
    bad = CliRunner().invoke(app, ["check", "-m", "random:tiny-llama", "--policies", "snapkv,lagkv"])
    assert bad.exit_code == 2 and "lagkv" in bad.output and len(bad.output.strip().splitlines()) == 1


def test_the_timing_verdict_is_skipped_without_timing_anything(tiny_llama, monkeypatch):
    def untimed(*args, **kwargs):
        raise AssertionError("timed")

    monkeypatch.setattr(check, "stock_generate", untimed)
    monkeypatch.setattr(check, "kvbench_generate", untimed)
    result = check.check_timing(tiny_llama, [1, 2, 3], check.CheckSettings(timing=False))
    assert result.status == "skip" and "--no-timing" in result.detail


def test_a_policy_with_a_reference_is_checkable_without_editing_check(tiny_llama, monkeypatch):
    from kvbench.policies import POLICIES
    from kvbench.policies.streaming_llm import StreamingLLM

    class Sinks(StreamingLLM):  # a plugin: its own name, its reference beside it
        name = "sinks_plugin"

        def reference(self, lm, prompt, decode, budget):
            from kvbench.policies.reference import streaming_llm_reference

            return streaming_llm_reference(lm, prompt, decode, budget, self.sinks)

    class Unreferenced(StreamingLLM):  # a subclass is another policy: it does not inherit its parent's reference
        name = "unreferenced_plugin"

    for cls in (Sinks, Unreferenced):
        monkeypatch.setitem(POLICIES._entries, cls.name, cls)
    assert set(check.checkable()) == {"snapkv", "h2o", "tova", "knorm", "streaming_llm", "qfilter", "kvzap",
                                      "sinks_plugin"}
    settings = check.CheckSettings(short=64, long=64, decode_steps=4, policies=("sinks_plugin",))
    result = check.check_policy(tiny_llama, "sinks_plugin", check.prompt_tokens(tiny_llama, 68)[:64],
                                check.prompt_tokens(tiny_llama, 68)[64:], "short")
    assert settings.policies == ("sinks_plugin",) and result.status == "pass", result.detail


def test_a_compiled_step_that_decodes_otherwise_fails_compiled(sharp_llama, monkeypatch):
    import kvbench.engine.session as engine_session

    def off_by_a_little(lm, cache, ids):  # the compiled step, its logits off by more than the model's rounding
        return engine_session.static_step(lm, cache, ids) * 1.01

    monkeypatch.setattr(engine_session, "compiled_step", lambda device: off_by_a_little)
    result = check.check_compiled(sharp_llama, check.prompt_tokens(sharp_llama, 64), SETTINGS)
    assert result.status == "fail" and "compiled against eager" in result.detail
