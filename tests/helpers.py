from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from kvbench.checks.suite import kept_masks
from kvbench.checks.tolerance import forward_roundings, magnitude, relative_tolerance
from kvbench.engine.session import Session
from kvbench.engine.settings import RunSettings
from kvbench.policies import build_policy

# what a policy needs on the tests' random models and has no default for: duoattention's head pattern (random:tiny-llama
# and tiny-qwen2: 2 layers x 2 KV heads) and sinks that fit the tests' budgets; the calibrated policies' artifacts for
# random:tiny-llama (`kvbench calibrate -m random:tiny-llama --tokens 128 -o DIR` with `--method qfilter --documents
# 2`, `--method kvzap-linear --documents 6`, `--method expected-attention --documents 2`)
DATA = Path(__file__).with_name("data")
NEEDED_PARAMS: dict[str, dict[str, Any]] = {
    "duoattention": {"pattern": str(DATA / "tiny-llama-pattern.tsv"), "sinks": 4},
    "qfilter": {"filters": str(DATA / "tiny-llama-qfilter")},
    "kvzap": {"model_type": "linear", "kvzap_model": str(DATA / "tiny-llama-kvzap")},
    "expected_attention_stats": {"stats_folder": str(DATA / "tiny-llama-expected-attention")}}


def tiny_policy(name: str, params: dict[str, Any] | None = None):
    """`name` at its defaults (and `params`), given what it needs on the tests' models (`NEEDED_PARAMS`)."""
    return build_policy(name, {**NEEDED_PARAMS.get(name, {}), **(params or {})})


def run_session(lm, policy, prompt, decode, budget, chunk=None, evict_every=1):
    """Prefill `prompt` (in chunks if given) then step `decode` tokens one by one in a session; return the
    session and the kept masks after the prompt and after each decode token."""
    settings = RunSettings(budget=budget, prefill="chunked" if chunk else "full", prefill_chunk=chunk or 512,
                           evict_every=evict_every)
    session = Session(lm, policy, settings, prompt_tokens=len(prompt), adds=len(decode))
    session.prefill(prompt)
    history = [kept_masks(session.cache)]
    for token in decode:
        session.step(token)
        history.append(kept_masks(session.cache))
    return session, history


def run_cache(lm, policy, prompt, decode, budget, chunk=None, evict_every=1):
    """`run_session`'s cache and kept masks."""
    session, history = run_session(lm, policy, prompt, decode, budget, chunk, evict_every)
    return session.cache, history


def assert_rejected_in_one_line(config, culprit: str, run) -> None:
    """`kvbench validate` and `kvbench sweep` of a bad config: exit code 2, one line naming `culprit`, no run
    folder written."""
    from typer.testing import CliRunner

    from kvbench.cli import app

    for command in (["validate", str(config)], ["sweep", str(config), "-o", str(run)]):
        result = CliRunner().invoke(app, command)
        assert result.exit_code == 2, result.output
        assert culprit in result.output, result.output
        assert len(result.output.strip().splitlines()) == 1 and "Traceback" not in result.output
    assert not run.exists()


# --- tolerances: from the dtype, the roundings and the values' magnitude (kvbench/checks/tolerance.py) ---------------

def tolerance(expected, *, roundings: float, dtype: torch.dtype = torch.float32, floor: float = 1.0) -> float:
    """The absolute tolerance for a result of `roundings` roundings in `dtype` whose magnitude is `expected`'s
    (at least `floor`)."""
    return relative_tolerance(dtype, roundings) * magnitude(expected, floor)


def model_tolerance(lm, expected, floor: float = 1.0) -> float:
    """`tolerance` for an output of `lm`'s forward (a logit, a log-probability, a perplexity's log) in its dtype."""
    return tolerance(expected, roundings=forward_roundings(lm.model.config, lm.dtype), dtype=lm.dtype, floor=floor)


def assert_close(actual, expected, *, roundings: float, dtype: torch.dtype = torch.float32, floor: float = 1.0,
                 msg: str | None = None) -> None:
    """`actual` within `tolerance` of `expected`: another order of the same arithmetic, nothing more."""
    atol = tolerance(expected, roundings=roundings, dtype=dtype, floor=floor)
    torch.testing.assert_close(torch.as_tensor(actual).double(), torch.as_tensor(expected).double(), rtol=0,
                               atol=atol, msg=msg)


def assert_model_close(lm, actual, expected, floor: float = 1.0, msg: str | None = None) -> None:
    """`assert_close` for outputs of `lm`'s forward."""
    assert_close(actual, expected, roundings=forward_roundings(lm.model.config, lm.dtype), dtype=lm.dtype,
                 floor=floor, msg=msg)


def model_approx(lm, expected, floor: float = 1.0):
    """`pytest.approx(expected)` within `model_tolerance`: `==` for the same result, `!=` for a changed one."""
    return pytest.approx(expected, rel=0, abs=model_tolerance(lm, expected, floor))
