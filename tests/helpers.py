from __future__ import annotations

from pathlib import Path
from typing import Any

from kvbench.check import kept_masks
from kvbench.policies import build_policy
from kvbench.session import RunSettings, Session

# what a policy needs on the tests' random models and has no default for: duoattention's head pattern (random:tiny-llama
# and tiny-qwen2: 2 layers x 2 KV heads) and sinks that fit the tests' budgets
NEEDED_PARAMS: dict[str, dict[str, Any]] = {
    "duoattention": {"pattern": str(Path(__file__).with_name("data") / "tiny-llama-pattern.tsv"), "sinks": 4}}


def tiny_policy(name: str, params: dict[str, Any] | None = None):
    """`name` at its defaults (and `params`), given what it needs on the tests' models (`NEEDED_PARAMS`)."""
    return build_policy(name, {**NEEDED_PARAMS.get(name, {}), **(params or {})})


def run_session(lm, policy, prompt, decode, budget, chunk=None, evict_every=1):
    """Prefill `prompt` (in chunks if given) then step `decode` tokens one by one in a session; return the
    session and the kept masks after the prompt and after each decode token."""
    settings = RunSettings(budget=budget, prefill="chunked" if chunk else "full", prefill_chunk=chunk or 512,
                           evict_every=evict_every)
    session = Session(lm, policy, settings, prompt_tokens=len(prompt), growth=len(decode))
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
