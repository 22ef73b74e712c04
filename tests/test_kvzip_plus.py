"""KVzip+ keeps what its definition says (KVzip's reconstruction attention, normalised as kvpress's kvzip_plus),
checked against the plain reference that recomputes it from a stock cache and the model's own projections."""

from __future__ import annotations

import pytest
import torch

from kvbench.policies import build_policy
from tests.helpers import run_session
from tests.test_kvpress_policies import BUDGET, DECODE, PROMPT, kvzip_reference


@pytest.mark.parametrize(("chunk", "layerwise"), [(2048, False), (40, True)])
def test_kvzip_plus_keeps_what_the_normalised_reconstruction_attends_to(sharp_llama, chunk, layerwise):
    policy = build_policy("kvzip_plus", {"chunk": chunk, "layerwise": layerwise})
    session, history = run_session(sharp_llama, policy, PROMPT, DECODE, BUDGET)
    expected = kvzip_reference(sharp_llama, PROMPT, BUDGET, chunk, 4, layerwise, plus=True)
    for layer, (mine, reference) in enumerate(zip(history[0], expected, strict=True)):
        assert torch.equal(mine, reference), f"layer {layer}"
    assert sum(int(m.sum()) for m in history[0]) == sharp_llama.num_layers * sharp_llama.kv_heads * BUDGET
    assert all(layer.seen == len(PROMPT) + len(DECODE) for layer in session.cache.layers)


def test_the_normalisation_changes_what_kvzip_keeps(sharp_llama):
    """Without its normalisation KVzip+ would be KVzip: the two keep different entries on the same prompt."""
    _, plain = run_session(sharp_llama, build_policy("kvzip"), PROMPT, [], BUDGET)
    _, plus = run_session(sharp_llama, build_policy("kvzip_plus"), PROMPT, [], BUDGET)
    assert not all(torch.equal(a, b) for a, b in zip(plain[0], plus[0], strict=True))
