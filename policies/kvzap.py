from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kvbench.calibration import kvzap
from kvbench.calibration.calibrate import calibrated_folder, read_artifact
from kvbench.engine.attention import record_attention_inputs
from kvbench.errors import KvbenchError
from kvbench.policies.base import PromptScorer, protect, recent_mask, register
from kvbench.policies.reference import Reference, kvzap_kept

if TYPE_CHECKING:
    from kvbench.calibration.kvzap import Surrogate

MODEL_TYPES = ("linear", "mlp")


@register
@dataclass
class KVzap(PromptScorer):
    """KVzap (arXiv 2601.07891; kvpress's KVzapPress): a small per-layer model predicts each token's log KVzip+ score
    from the hidden state its attention reads, as the token is written, so no reconstruction pass is needed.

    At a budget each KV head keeps the entries with the highest prediction (KVzapPress alone). Under a threshold t
    an entry stays while exp(prediction) >= t, and the newest `window` tokens always stay: kvpress's
    DMSPress(KVzapPress, threshold=log t, sliding_window_size=window); with `decode: true` it keeps evicting while
    decoding (DMSPress's decoding=True: a token is judged once it leaves the window; its score never changes).
    `model_type`: linear (ridge) or mlp; `kvzap_model`: a folder in kvpress's KVzapModel format, default the model's
    own calibration in `$KVBENCH_CACHE/kvzap-<model_type>/` (`kvbench calibrate --method kvzap-<model_type>`).
    """

    name = "kvzap"
    threshold_scale = "exp of the predicted KVzip+ score (kvpress's DMSPress threshold is its log), newest window kept"
    needs_attention = True  # its observe scores the new tokens
    model_type: str = "mlp"
    kvzap_model: str | None = None
    window: int = 128

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.model_type not in MODEL_TYPES:
            raise KvbenchError(f"policy 'kvzap' parameter 'model_type' must be one of {', '.join(MODEL_TYPES)}, got "
                               f"'{self.model_type}'")
        if self.window < 0:
            raise KvbenchError(f"policy 'kvzap' parameter 'window' must be >= 0, got {self.window}")
        self._surrogate: Surrogate | None = None

    def prepare(self, lm) -> None:
        self._surrogate = self.load(lm)
        record_attention_inputs(lm.model)

    def load(self, lm) -> Surrogate:
        """The surrogate for `lm` on its device (read once per model: shared, not to be changed), checked against its
        shape; a missing artifact names the command that makes it."""
        folder = calibrated_folder(lm, "kvzap", f"kvzap-{self.model_type}", self.kvzap_model, "KVzap model", "it")
        surrogate = read_artifact(lm, folder, "kvzap", lambda found: kvzap.load(found).to(lm.device))
        shape, expected = (len(surrogate.layers), surrogate.input_dim), (lm.num_layers, lm.model.config.hidden_size)
        if shape != expected:
            raise KvbenchError(f"policy 'kvzap': the KVzap model in {folder} is for {shape} (layers, hidden size); "
                               f"{lm.spec} needs {expected}")
        return surrogate

    def observe(self, layer, query, key, scaling, phase) -> None:
        if self._surrogate is None:
            raise KvbenchError("policy 'kvzap' reads its model when a session is made (prepare)")
        assert layer.attention_input is not None, "prepare() asked for the attention's inputs"
        layer.slot_stat(self.state_key)[:, :, -query.shape[2]:] = kvzap.predict(self._surrogate, layer.layer_idx,
                                                                           layer.attention_input)

    def score(self, layer, budget: int) -> torch.Tensor:
        return layer.slot_stat(self.state_key)

    def threshold_score(self, layer) -> torch.Tensor:
        return protect(layer.slot_stat(self.state_key).exp(), recent_mask(layer, self.window))

    def reference(self, lm, prompt, decode, budget) -> Reference:
        return kvzap_kept(lm, prompt, budget, list(copy.deepcopy(self.load(lm)).layers))  # it moves them to the CPU
