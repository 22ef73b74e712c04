"""Wrappers (compose, hybrid, adaptive, ada_kv, chunkkv, criticalkv, whole_segments) forward every policy hook to
their stages by construction, and what the engine asks of a policy's kind reaches the stage in charge."""

from __future__ import annotations

import dataclasses
import functools
import inspect
from types import SimpleNamespace

import pytest
import torch

from kvbench.engine.cache import Phase
from kvbench.errors import KvbenchError
from kvbench.policies import POLICIES, Demand, Policy, build_policy
from kvbench.policies.base import (
    LayerSpread,
    Merging,
    Schedule,
    Sparse,
    Wrapper,
    fold_evicted,
    hooks,
    observers_of,
    sparse_reads,
    spread_budgets,
    state_keys_of,
)
from tests.conftest import random_ids
from tests.helpers import run_session

# Policy's public members that are not hooks: what a policy *is* (name, parameters, storage, statistic names),
# not what the cache asks of it while running. A new member must be added here or be a @hook.
NOT_HOOKS = {"describe", "evicts_during_decode", "phases", "kind", "layout", "params", "state_key", "check",
             "check_budget", "check_settings", "check_threshold", "reference", "ring", "static_blocker"}
ANSWERS = {"report": {}, "layer_budgets": [1], "batch_limits": [], "bounded": True}


def public_members(cls: type) -> set[str]:
    return {name for name, member in vars(cls).items()
            if not name.startswith("_") and (callable(member) or isinstance(member, (property, classmethod,
                                                                                        functools.cached_property)))}


def test_every_public_member_of_policy_is_a_hook_or_declared_not_one():
    assert public_members(Policy) - set(hooks()) == NOT_HOOKS
    assert set(hooks()) == {"observe", "score", "threshold_score", "select", "bounded", "prepare", "after_prompt",
                            "report", "batch_limits"}


WRAPPERS = sorted(name for name in POLICIES.names() if issubclass(POLICIES.get(name), Wrapper))


def test_the_registered_wrappers_are_the_known_ones():
    assert WRAPPERS == ["ada_kv", "adaptive", "chunkkv", "compose", "criticalkv", "hybrid", "whole_segments"]


class Spy(Policy):
    """Answers every hook and records which were called."""

    name = "spy"

    def __init__(self) -> None:  # no dataclass fields: a spy has no parameters
        self.storage, self._storage, self.calls = None, None, []


def _recorder(name: str):
    def record(self, *args, **kwargs):
        self.calls.append(name)
        return ANSWERS.get(name)
    return record


for _name in hooks():
    setattr(Spy, _name, _recorder(_name))


def call_hook(policy: Policy, name: str, cache) -> None:
    layer = SimpleNamespace(owner=cache)
    arguments = {"observe": (layer, None, None, 1.0, cache.phase), "score": (layer, 8), "select": (layer, 8),
                 "threshold_score": (layer,), "report": (), "batch_limits": (),
                 "after_prompt": (SimpleNamespace(cache=cache, segments=()), None), "prepare": (None,),
                 "bounded": (layer,)}
    getattr(policy, name)(*arguments[name])


@pytest.mark.parametrize("wrapper", WRAPPERS)
@pytest.mark.parametrize("phase", [Phase.PREFILL, Phase.DECODE])
def test_each_wrapper_forwards_every_hook_to_the_stage_it_concerns(wrapper, phase):
    params = {"limit_bytes": 1} if wrapper == "adaptive" else {}  # switched at once: its fallback is in charge
    policy = build_policy(wrapper, params)
    policy._stages = tuple(Spy() for _ in policy._stages)
    cache = SimpleNamespace(phase=phase, live_bytes=lambda: 10, layers=[SimpleNamespace(seen=5)])
    for name, scope in hooks().items():
        if name in policy.decides:
            continue
        for spy in policy._stages:
            spy.calls.clear()
        call_hook(policy, name, cache)
        reached = [spy for spy in policy._stages if name in spy.calls]
        expected = {"all": list(policy._stages), "first": [policy._stages[0]], "active": [policy.stage(cache)]}
        assert reached == expected[scope], f"{wrapper}.{name} in {phase.value}"



class KindSpy(Spy, Merging, LayerSpread, Sparse):
    """A stage of every kind, recording which of its kind's methods were called."""

    name = "kind_spy"
    needs_attention = True

    def fold(self, layer, evicted):
        self.calls.append("fold")

    def layer_budgets(self, budget, num_layers, prompt_tokens=None):
        self.calls.append("layer_budgets")
        return [budget] * num_layers

    def read_mask(self, layer, query, budget):
        self.calls.append("read_mask")


@pytest.mark.parametrize("wrapper", WRAPPERS)
@pytest.mark.parametrize("phase", [Phase.PREFILL, Phase.DECODE])
def test_what_the_engine_asks_of_a_kind_reaches_the_stage_in_charge(wrapper, phase):
    """fold and read_mask reach the stage in charge of the cache, layer_budgets the first (the prompt's); the
    statistics to gather are every stage's."""
    params = {"limit_bytes": 1} if wrapper == "adaptive" else {}
    policy = build_policy(wrapper, params)
    policy._stages = tuple(KindSpy() for _ in policy._stages)
    cache = SimpleNamespace(phase=phase, live_bytes=lambda: 10, layers=[SimpleNamespace(seen=5)])
    layer = SimpleNamespace(owner=cache)
    for name, ask, expected in [("fold", lambda: fold_evicted(policy, layer, None), policy.stage(cache)),
                                ("read_mask", lambda: sparse_reads(policy, layer, None, 8), policy.stage(cache)),
                                ("layer_budgets", lambda: spread_budgets(policy, 8, 2), policy._stages[0])]:
        for spy in policy._stages:
            spy.calls.clear()
        ask()
        assert [spy for spy in policy._stages if name in spy.calls] == [expected], f"{wrapper}.{name}"
    assert observers_of(policy) == list(policy._stages)
    assert len(state_keys_of(policy)) == len(policy._stages)


@pytest.mark.parametrize("method, kind", [("fold", "Merging"), ("read_mask", "Sparse"),
                                          ("layer_budgets", "LayerSpread"), ("observers", None)])
def test_a_kinds_method_on_a_policy_of_another_kind_is_an_error_naming_the_kind(method, kind):
    with pytest.raises(KvbenchError, match=f"defines `{method}`.*{kind or 'needs_attention'}"):
        type("Plugin", (Policy,), {method: lambda self, *args: None})


def test_what_a_wrapper_decides_itself_is_declared():
    """A wrapper's own hook methods either still reach the stages (tested above) or are listed in `decides`."""
    for name in WRAPPERS:
        cls = POLICIES.get(name)
        own = {hook for hook in hooks() if not getattr(inspect.getattr_static(cls, hook), "forwards", False)}
        assert cls.decides <= own, name
    assert POLICIES.get("ada_kv").decides == {"select"}


def test_compose_picks_the_stage_by_phase():
    policy = build_policy("compose")
    assert policy.stage(SimpleNamespace(phase=Phase.PREFILL)).name == "snapkv"
    assert policy.stage(SimpleNamespace(phase=Phase.DECODE)).name == "h2o"


def test_compose_with_pyramidkv_uses_its_layer_budgets(tiny_llama):
    pyramid = {"name": "pyramidkv", "window": 8, "beta": 4}
    policy = build_policy("compose", {"prefill": pyramid, "decode": "h2o"})
    expected = build_policy("pyramidkv", {"window": 8, "beta": 4}).layer_budgets(48, tiny_llama.num_layers)
    assert spread_budgets(policy, 48, tiny_llama.num_layers) == expected and len(set(expected)) > 1
    session, _ = run_session(tiny_llama, policy, random_ids(120, seed=1), random_ids(6, seed=2), budget=48)
    held = [int(layer.held_counts().max()) for layer in session.cache.layers]
    assert held == expected  # the pyramid holds while decoding


def _represented(session) -> list[int]:
    """Per layer, the tokens the entries stand for (each entry itself plus what was merged into it)."""
    merge = next(stage for stage in session.policy._stages if stage.name == "merge")
    return [int((1 + layer.slot_stat(merge.state_key)).sum(-1).min()) for layer in session.cache.layers]


@pytest.mark.parametrize("wrapper", ["compose", "adaptive"])
def test_a_merge_stage_merges(tiny_llama, wrapper):
    merge = {"name": "merge", "recent": 8, "sinks": 2}
    params = {"prefill": "window", "decode": merge} if wrapper == "compose" else {"limit_bytes": 1, "fallback": merge}
    prompt, decode = random_ids(40, seed=3), random_ids(30, seed=4)  # the prompt fits: decode evicts 22 tokens
    session, _ = run_session(tiny_llama, build_policy(wrapper, params), prompt, decode, budget=48)
    assert session.cache.evictions > 0 and session.cache.layers[0].length == 48
    assert _represented(session) == [len(prompt) + len(decode)] * tiny_llama.num_layers


def test_stages_take_no_storage_of_their_own():
    from kvbench.errors import KvbenchError

    with pytest.raises(KvbenchError, match="give storage to 'compose' itself"):
        build_policy("compose", {"prefill": {"name": "snapkv", "storage": "quant"}})
    assert build_policy("compose", {"storage": {"quant": {"bits": 4}}}).layout() is not None


def test_adaptive_reports_its_switch_and_its_stage(tiny_llama):
    session, _ = run_session(tiny_llama, build_policy("adaptive", {"limit_bytes": 1, "fallback": "window"}),
                             random_ids(40, seed=5), random_ids(4, seed=6), budget=32)
    report = session.policy.report()
    assert report["switched_at_token"] == 40 and report["limit_bytes"] == 1
    layer = session.cache.layers[0]
    assert torch.equal(layer.live_positions()[0, 0][layer.held_slots()[0, 0]].sort().values, torch.arange(12, 44))


@pytest.mark.parametrize("phases,schedule", [((), Schedule.NONE), (("prefill",), Schedule.PREFILL),
                                             (("prefill", "decode"), Schedule.DECODE)])
def test_a_plugin_declaring_phases_gets_that_schedule_and_a_deprecation_warning(phases, schedule):
    with pytest.warns(DeprecationWarning, match="`phases` is deprecated"):
        plugin = dataclasses.dataclass(type("Plugin", (Policy,), {"name": "plugin_with_phases", "phases": phases}))
    assert plugin.schedule is schedule and plugin().phases == phases
    assert plugin().evicts_during_decode == (schedule is Schedule.DECODE)


def _plugin(members: dict) -> type[Policy]:
    with pytest.warns(DeprecationWarning, match="is deprecated and goes in the next release"):
        return dataclasses.dataclass(type("Plugin", (Policy,), {"name": "old_plugin", **members}))


def test_a_plugin_validating_in_the_former_hooks_is_checked_by_check():
    def check_budget(self, budget):
        super(plugin, self).check_budget(budget)
        if budget < 10:
            raise KvbenchError(f"old_plugin: budget {budget} under 10")

    def check_settings(self, chunked):
        if chunked:
            raise KvbenchError("old_plugin: no chunks")
    plugin = _plugin({"check_budget": check_budget, "check_settings": check_settings})
    plugin().check(Demand(budget=10))
    for demand, message in ((Demand(budget=9), "under 10"), (Demand(budget=0), "at least 1"),
                            (Demand(chunked=True), "no chunks"), (Demand(budget=12, threshold=True), "no threshold")):
        with pytest.raises(KvbenchError, match=message):
            plugin().check(demand)


def test_the_former_validation_methods_still_check_a_current_policy():
    with pytest.raises(KvbenchError, match="must exceed the observation window"):
        build_policy("snapkv").check_budget(8)
    with pytest.raises(KvbenchError, match="prefill mode 'full'"):
        build_policy("kvzip").check_settings(chunked=True)
    with pytest.raises(KvbenchError, match="takes no threshold budget"):
        build_policy("streaming_llm").check_threshold()


def test_a_plugin_declaring_active_or_eviction_periods_gets_bounded_and_its_schedule():
    plugin = _plugin({"active": lambda self, cache: cache.waiting is False,
                      "eviction_periods": lambda self: [16, 64]})
    assert plugin().schedule == Schedule.DECODE.each(64)
    layer = SimpleNamespace(owner=SimpleNamespace(waiting=True))
    assert plugin().bounded(layer) is False
    layer.owner.waiting = False
    assert plugin().bounded(layer) is True


def test_a_wrapper_evicts_as_often_as_its_most_patient_stage():
    assert build_policy("hybrid", {"decode": {"name": "rkv", "buffer": 32}}).schedule == Schedule.DECODE.each(32)
    assert build_policy("adaptive", {"fallback": {"name": "rkv", "buffer": 48}}).schedule.every == 48
    assert build_policy("criticalkv", {"base": "rkv"}).schedule.every == 128
    assert build_policy("hybrid").schedule == Schedule.DECODE
