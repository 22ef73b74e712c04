"""KVzap's surrogates (arXiv 2601.07891; kvpress's kvzap/train.py): per layer, a model from the
attention's input hidden state of a token to the log of its KVzip+ score, one output per KV head, so that a cache can
be scored as it is written, without KVzip's reconstruction pass.

The targets are the `kvzip_plus` policy's own scores (policies/kvzip.py: KVzip's reconstruction attention, each
weight over the query's hidden-state norm and times ||W_o^h v||, max-pooled over the repetition and the KV group),
recorded on corpus windows before anything is evicted; the features are the same prompt's attention inputs. `linear`
fits a ridge regression per layer (scikit-learn's `Ridge()`: alpha 1, an intercept) from streamed sums, so its
memory does not grow with the samples; `mlp` trains kvpress's two-layer GELU MLP per layer, all layers at once
(AdamW, a cosine schedule over the epochs, gradients clipped to norm 1, mean squared error), on samples held in the
model's dtype. The last `held_out` documents are never trained on: every position of theirs gives the R^2 and the
kept-set agreement reported with the artifact.

The artifact is kvpress's `KVzapModel` (`config.json` and `model.safetensors`: `layers.<i>.weight` / `.bias`, or
`layers.<i>.0.*` and `layers.<i>.2.*` for the MLP), which `KVzapModel.from_pretrained(folder)` loads.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar, cast

import torch
from torch import nn

from kvbench.calibration.artifacts import CONFIG_FILE, read_weights, write_artifact
from kvbench.engine.session import Session
from kvbench.engine.settings import RunSettings
from kvbench.errors import KvbenchError
from kvbench.policies.kvzip import KVzipPlus

if TYPE_CHECKING:
    from kvbench.calibration.methods import Settings
    from kvbench.engine.models import LoadedModel

RIDGE_ALPHA = 1.0  # scikit-learn Ridge's default, which kvpress's train_linear uses
LEARNING_RATE, BATCH = 5e-3, 512  # kvpress's train.py defaults
AGREEMENT_BUDGET = 0.5  # the share of each held-out document whose kept sets are compared
WEIGHTS = "weights."  # the state's keys among the calibration's saved tensors


class Surrogate(nn.Module):
    """kvpress's `KVzapModel` layout: `layers[i]` a Linear, or Linear-GELU-Linear `hidden_dim` wide (None: linear)."""

    def __init__(self, input_dim: int, output_dim: int, n_modules: int, hidden_dim: int | None) -> None:
        super().__init__()
        self.input_dim, self.output_dim, self.hidden_dim = input_dim, output_dim, hidden_dim
        self.layers = nn.ModuleList(
            [nn.Linear(input_dim, output_dim) if hidden_dim is None else
             nn.Sequential(nn.Linear(input_dim, hidden_dim), nn.GELU(), nn.Linear(hidden_dim, output_dim))
             for _ in range(n_modules)])


def predict(surrogate: Surrogate, layer_idx: int, hidden: torch.Tensor) -> torch.Tensor:
    """`[B, kv_heads, n]` predicted log KVzip+ scores of the hidden states `[B, n, hidden]` (float32)."""
    module = surrogate.layers[layer_idx]
    return module(hidden.to(next(module.parameters()).device).float()).transpose(1, 2)


def save(surrogate: Surrogate, folder: Path, provenance: dict) -> None:
    """kvpress's `KVzapModel.save_pretrained` files, with kvbench's provenance (and the held-out scores) beside."""
    write_artifact(folder, surrogate.state_dict(), {
        "architectures": ["KVzapModel"], "model_type": "kvzap", "input_dim": surrogate.input_dim,
        "output_dim": surrogate.output_dim, "hidden_dim": surrogate.hidden_dim, "n_modules": len(surrogate.layers),
        "dtype": "float32"}, provenance)


def load(folder: Path) -> Surrogate:
    """A surrogate from a folder in kvpress's format (kvbench's, or one of the `nvidia/KVzap-*` downloads)."""
    config = json.loads((folder / CONFIG_FILE).read_text())
    surrogate = Surrogate(config["input_dim"], config["output_dim"], config["n_modules"], config["hidden_dim"])
    surrogate.load_state_dict({name: tensor.float() for name, tensor in read_weights(folder).items()})
    return surrogate.eval()


@dataclass
class _KVzipPlusTargets(KVzipPlus):
    """KVzip+ recording, for a calibration, the prompt's attention inputs `[n, hidden]` per layer as its forward
    passes, and per layer its KVzip+ scores `[kv_heads, held]` and their positions `[held]` once the reconstruction
    has run (before any eviction: every head holds the same positions, all of them but what slid out of a window)."""

    name: ClassVar[str] = "kvzap-calibration"

    def __post_init__(self) -> None:
        super().__post_init__()
        self.hidden: list[torch.Tensor] = []
        self.scores: list[torch.Tensor] = []
        self.positions: list[torch.Tensor] = []

    def observe(self, layer, query, key, scaling, phase) -> None:
        if self._probe is None:  # the prompt itself, not its reconstruction
            assert layer.attention_input is not None
            self.hidden.append(layer.attention_input[0].float().cpu())
        super().observe(layer, query, key, scaling, phase)

    def after_prompt(self, session, prompt: torch.Tensor) -> None:
        super().after_prompt(session, prompt)
        self.scores = [layer.slot_stat(self.state_key)[0].float().cpu() for layer in session.cache.layers]
        self.positions = [layer.live_positions()[0, 0].cpu() for layer in session.cache.layers]


def targets(lm: LoadedModel, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """A document's features `[layers, n, hidden]` and targets `[layers, n, kv_heads]`: log KVzip+ scores. A position
    a layer no longer holds (it slid out of a sliding layer's window) or whose score is 0 (no reconstruction query
    could see it: a sliding layer's early positions) has no target: NaN, left out of the fit and of its scores."""
    recorder = _KVzipPlusTargets()
    # a budget below the prompt, or KVzip+ has nothing to evict and skips its reconstruction
    Session(lm, recorder, RunSettings(budget=len(ids) // 2), prompt_tokens=len(ids)).prefill(torch.tensor([ids]))
    scores = torch.full((lm.num_layers, len(ids), lm.kv_heads), math.nan)
    for layer, (held, positions) in enumerate(zip(recorder.scores, recorder.positions, strict=True)):
        scores[layer, positions] = held.T.log()
    return torch.stack(recorder.hidden), scores.masked_fill(scores == -math.inf, math.nan)


def fit(lm: LoadedModel, documents: list[list[int]], settings: Settings, model_type: str,
        advance: Callable[[int, int], None], skip: int = 0) -> dict[str, torch.Tensor]:
    """The surrogate's weights (`WEIGHTS` + its state's names), `r2` `[layers]` and `agreement` on the held-out
    documents, and `hidden_dim` (0: linear), as the per-model cache keeps them. The first `skip` positions of each
    document (the chat template's opening a window starts with) run but are neither trained on nor scored: kvpress's
    collector samples the text's positions only."""
    if model_type not in ("linear", "mlp"):
        raise KvbenchError(f"kvzap: model type '{model_type}' is not one of linear, mlp")
    generator = torch.Generator().manual_seed(settings.seed)
    training = len(documents) - settings.held_out
    ridge = _RidgeSums(lm.num_layers) if model_type == "linear" else None
    samples: list[tuple[torch.Tensor, torch.Tensor]] = []
    held_out: list[tuple[torch.Tensor, torch.Tensor]] = []
    for index, ids in enumerate(documents):
        features, scores = (values[:, skip:] for values in targets(lm, ids))
        if index >= training:
            held_out.append((features, scores))
        else:
            chosen = torch.randperm(len(ids) - skip, generator=generator)[: settings.samples]
            if ridge is not None:
                ridge.add(features[:, chosen], scores[:, chosen])
            else:  # held in the model's dtype, as kvpress holds them
                samples.append((features[:, chosen].to(lm.dtype), scores[:, chosen].to(lm.dtype)))
        advance(index + 1, len(documents))
    surrogate = ridge.solve() if ridge is not None else _train_mlp(samples, settings, lm.device)
    r2, agreement = evaluate(surrogate, held_out)
    return {**{WEIGHTS + name: tensor.detach().cpu() for name, tensor in surrogate.state_dict().items()},
            "r2": r2, "agreement": torch.tensor(agreement),
            "hidden_dim": torch.tensor(0 if model_type == "linear" else settings.hidden_dim)}


def rebuilt(saved: dict[str, torch.Tensor]) -> Surrogate:
    """The surrogate `fit` returned, rebuilt from the tensors the per-model cache keeps."""
    hidden_dim = int(saved["hidden_dim"]) or None
    first = saved[WEIGHTS + ("layers.0.weight" if hidden_dim is None else "layers.0.0.weight")]
    output = saved[WEIGHTS + ("layers.0.weight" if hidden_dim is None else "layers.0.2.weight")]
    layers = len({name.split(".")[2] for name in saved if name.startswith(WEIGHTS)})
    modules = Surrogate(first.shape[1], output.shape[0], layers, hidden_dim)
    modules.load_state_dict({name.removeprefix(WEIGHTS): t for name, t in saved.items() if name.startswith(WEIGHTS)})
    return modules.eval()


def quality(saved: dict[str, torch.Tensor]) -> dict:
    """What the provenance file and `kvbench calibrate` report of the held-out documents (NaN: none held out)."""
    r2 = saved["r2"].tolist()
    return {"held_out_r2": sum(r2) / len(r2) if r2 else math.nan, "held_out_r2_per_layer": [round(v, 4) for v in r2],
            "kept_agreement": float(saved["agreement"]), "kept_agreement_budget": AGREEMENT_BUDGET}


@torch.no_grad()
def evaluate(surrogate: Surrogate, documents: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, float]:
    """On `documents` (features `[layers, n, hidden]`, targets `[layers, n, kv_heads]`): each layer's R^2 of the
    predicted log scores over every position and KV head, and the kept-set agreement: per document, layer and KV
    head, the Jaccard of the `AGREEMENT_BUDGET` share of positions with the highest KVzip+ score and of those with
    the highest prediction (1 identical, about 1/3 for two random halves), averaged. Empty without documents."""
    if not documents:
        return torch.zeros(0), math.nan
    predicted = [torch.stack([predict(surrogate, layer, features[layer][None])[0].T.cpu()
                              for layer in range(features.shape[0])]) for features, _ in documents]
    truth = torch.cat([scores for _, scores in documents], dim=1)  # [layers, positions, kv_heads]
    guess = torch.cat(predicted, dim=1)
    known = torch.isfinite(truth)
    mean = truth.nanmean(dim=(1, 2), keepdim=True)
    residual = torch.where(known, truth - guess, 0.0).pow(2).sum(dim=(1, 2))
    spread = torch.where(known, truth - mean, 0.0).pow(2).sum(dim=(1, 2))
    jaccards = []
    for (_, scores), prediction in zip(documents, predicted, strict=True):
        for layer in range(scores.shape[0]):
            held = torch.isfinite(scores[layer]).all(dim=-1)
            count = max(1, int(AGREEMENT_BUDGET * int(held.sum())))
            kept = [torch.zeros_like(s, dtype=torch.bool).scatter_(1, s.topk(count, dim=1).indices, True)
                    for s in (scores[layer][held].T, prediction[layer][held].T)]  # [kv_heads, held]
            jaccards.append((kept[0] & kept[1]).sum(1).double() / (kept[0] | kept[1]).sum(1).double())
    return 1 - residual / spread, torch.cat(jaccards).mean().item()


class _RidgeSums:
    """Per layer, the sums a ridge regression with an intercept needs over the positions with a target, added one
    document at a time in float64."""

    def __init__(self, layers: int) -> None:
        self.count = [0] * layers
        self.sums: list[list[torch.Tensor]] = [[] for _ in range(layers)]  # x, y, x^T x, x^T y

    def add(self, features: torch.Tensor, scores: torch.Tensor) -> None:
        for layer, sums in enumerate(self.sums):  # [n, hidden], [n, kv_heads]
            known = torch.isfinite(scores[layer]).all(dim=-1)
            x, y = features[layer][known].double(), scores[layer][known].double()
            added = [x.sum(0), y.sum(0), x.T @ x, x.T @ y]
            self.sums[layer] = added if not sums else [a + b for a, b in zip(sums, added, strict=True)]
            self.count[layer] += len(x)

    def solve(self) -> Surrogate:
        """Ridge on centred data (scikit-learn's): W = (Xc^T Xc + alpha I)^-1 Xc^T yc, intercept ybar - xbar W."""
        first = self.sums[0]
        surrogate = Surrogate(first[0].shape[0], first[1].shape[0], len(self.sums), None)
        for (x, y, xx, xy), count, module in zip(self.sums, self.count, surrogate.layers, strict=True):
            x_mean, y_mean = x / count, y / count
            centred_xx = xx - count * x_mean[:, None] * x_mean[None, :]
            centred_xy = xy - count * x_mean[:, None] * y_mean[None, :]
            weight = torch.linalg.solve(centred_xx + RIDGE_ALPHA * torch.eye(len(x), dtype=xx.dtype), centred_xy)
            cast(nn.Linear, module).weight.data = weight.T.float().contiguous()
            cast(nn.Linear, module).bias.data = (y_mean - x_mean @ weight).float()
        return surrogate.eval()


def _train_mlp(samples: list[tuple[torch.Tensor, torch.Tensor]], settings: Settings, device: torch.device) -> Surrogate:
    features = torch.cat([x for x, _ in samples], dim=1).transpose(0, 1)  # [N, layers, hidden]
    scores = torch.cat([y for _, y in samples], dim=1).transpose(0, 1)  # [N, layers, kv_heads]
    with torch.random.fork_rng(devices=[]):  # the seed decides the initial weights, the caller's stream untouched
        torch.manual_seed(settings.seed)
        surrogate = Surrogate(features.shape[2], scores.shape[2], features.shape[1], settings.hidden_dim)
    # each output starts at its targets' mean (log scores sit far below 0): a few hundred steps, as a CPU calibration
    # takes, then learn the spread instead of the offset
    for layer, module in enumerate(surrogate.layers):
        cast(nn.Linear, cast(nn.Sequential, module)[2]).bias.data = scores[:, layer].float().nanmean(dim=0)
    surrogate.to(device)
    optimiser = torch.optim.AdamW(surrogate.parameters(), lr=LEARNING_RATE)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimiser, T_max=settings.epochs)
    order = torch.Generator().manual_seed(settings.seed)
    with torch.enable_grad():
        for _ in range(settings.epochs):
            for batch in torch.randperm(len(features), generator=order).split(BATCH):
                x, y = features[batch].to(device).float(), scores[batch].to(device).float()
                predicted = torch.stack([module(x[:, i]) for i, module in enumerate(surrogate.layers)], dim=1)
                known = torch.isfinite(y)
                loss = nn.functional.mse_loss(predicted[known], y[known])
                optimiser.zero_grad()
                loss.backward()
                nn.utils.clip_grad_norm_(surrogate.parameters(), 1.0)
                optimiser.step()
            schedule.step()
    return surrogate.cpu().eval()
