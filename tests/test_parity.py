"""The kvpress parity check's own parts (the check itself runs in .ci/lane-kvpress, with kvpress installed): every
case builds in kvbench and says why it may differ, agreement is measured as stated, and a drifted policy fails."""

from __future__ import annotations

import math

import pytest
import torch
import yaml

from kvbench.policies.base import build_spec
from parity.compare import CASES, Agreement, agreement, kvbench_masks, verdicts
from tests.conftest import random_ids
from tests.helpers import NEEDED_PARAMS

CONFIG = yaml.safe_load(CASES.read_text())


def test_every_case_builds_and_states_its_tolerance_and_reason():
    names = [case["name"] for case in CONFIG["cases"]]
    assert len(names) == len(set(names))
    assert {"snapkv", "streaming_llm", "knorm", "tova", "pyramidkv", "expected_attention", "keydiff", "lagkv",
            "chunkkv", "criticalkv", "ada_kv", "kvzip", "kvzip_plus", "qfilter", "kvzap", "dms_kvzap",
            "expected_attention_stats", "duoattention", "think", "snapkv+think"} <= set(names)
    for case in CONFIG["cases"]:
        # a case with a pattern reads the one parity.prepare writes; any pattern builds it here
        pattern = {"pattern": NEEDED_PARAMS["duoattention"]["pattern"]} if "pattern" in case else {}
        policy = build_spec({**case["kvbench"], **pattern})
        # a storage after a +; a threshold case is named for kvpress's threshold press around the policy (dms_snapkv)
        assert "+".join([policy.name, *(policy.storage or {})]) == case["name"].removeprefix("dms_")
        assert set(case.get("pattern", {})) <= {"sink_size", "recent_size"}
        assert case["agreement"] in ("jaccard", "nested", "channels") and case["kvpress"]["class"].endswith("Press")
        assert 0 < case["min_worst"] <= case["min_mean"] <= 1 and case["reason"]


def test_a_threshold_case_protects_the_window_kvpress_protects():
    """DMSPress keeps its last `sliding_window_size` tokens whatever their scores: the kvbench side must protect
    as many (SnapKV's observation window), or the two would differ by design."""
    cases = [case for case in CONFIG["cases"] if "threshold" in case]
    assert cases
    for case in cases:
        # kvzap's threshold applies to exp of the prediction, KVzapPress's to the prediction (a log score)
        theirs = case["kvpress"]["threshold"]
        assert case["kvpress"]["class"] == "DMSPress" and case["threshold"] == pytest.approx(
            math.exp(theirs) if case["kvpress"]["press"]["class"] == "KVzapPress" else theirs, rel=1e-12)
        assert case["kvpress"]["sliding_window_size"] == build_spec(case["kvbench"]).window


def test_agreement_is_jaccard_or_the_overlap_of_the_smaller_set():
    ours = torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 0, 0, 0, 0]], dtype=torch.bool)
    theirs = torch.tensor([[1, 1, 1, 0, 1, 0], [1, 1, 1, 1, 0, 0]], dtype=torch.bool)
    assert agreement(ours, theirs, "jaccard").tolist() == [3 / 5, 2 / 4]
    assert agreement(ours, theirs, "nested").tolist() == [3 / 4, 1.0]


@pytest.mark.parametrize("broken", [{"kernel": 1}, {"pooling": "max"}, {"window": 8}])
def test_a_drifted_policy_fails_its_case(sharp_llama, broken):
    """kvbench's own SnapKV standing in for kvpress's: the same settings agree exactly, a drifted one fails."""
    prompt, case = random_ids(120, seed=5), next(c for c in CONFIG["cases"] if c["name"] == "snapkv")
    assert drifted_verdicts(sharp_llama, case, broken, prompt) == [True, False]


@pytest.mark.parametrize("case_name,broken", [("think", {"window": 2}), ("snapkv+think", {"kernel": 1})])
def test_a_drifted_channel_choice_fails_its_case(sharp_llama, case_name, broken):
    """The same with the key channels: fewer window queries, or other survivors, choose other channels."""
    case = next(c for c in CONFIG["cases"] if c["name"] == case_name)
    assert drifted_verdicts(sharp_llama, case, broken, random_ids(200, seed=6)) == [True, False]


def drifted_verdicts(lm, case: dict, broken: dict, prompt: list[int]) -> list[bool]:
    """`case` judged against kvbench's own masks for it: as it is, and with its kvbench spec drifted by `broken`."""
    budget = len(prompt) // 2
    reference = kvbench_masks(lm, case["kvbench"], prompt, budget, case["agreement"])
    rows = []
    for spec in (case["kvbench"], {**case["kvbench"], **broken}):
        values = torch.cat([agreement(ours, theirs, case["agreement"]) for ours, theirs in
                            zip(kvbench_masks(lm, spec, prompt, budget, case["agreement"]), reference, strict=True)])
        rows.append(Agreement(case["name"], "tiny", values.mean().item(), values.min().item(), 0, 0))
    return [passed for _, passed in verdicts(rows, CONFIG)]
