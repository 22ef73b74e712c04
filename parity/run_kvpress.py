"""The kvpress side of the parity check, run in an environment with kvpress 0.5.5 and no kvbench:

    python -m parity.run_kvpress WORK [--case NAME ...]   # reads WORK/models, WORK/prompts.json; writes WORK/kvpress.pt

For every model, prompt and case of parity/cases.yaml: the prompt through the model under the case's press, then
per layer a `[kv_heads, prompt]` mask of the positions the compressed cache holds (for a case of `agreement:
channels`, a `[kv_heads, head_dim]` mask of the key channels it keeps). A kept key is located among the
keys of the same prompt without a press (an exact match), so nothing depends on a press's layout; a press that
masks entries instead of dropping them (AdaKV, KVzip) holds every position it does not mask. A case with
`press_counts: true` gives its press no compression ratio: it keeps what its own parameters say (SimLayerKV).
"""

from __future__ import annotations

import argparse
import json
import logging
from importlib.metadata import version
from pathlib import Path

import kvpress
import numpy as np
import torch
import transformers
import yaml
from transformers import AutoModelForCausalLM, DynamicCache

from parity import artifact_folder, kept_per_head, pattern_folder

CASES = Path(__file__).with_name("cases.yaml")


def build_press(spec: dict):
    """A press from `{class: Name, param: value, press: {class: ...}}` (a wrapper's inner press nested, a
    ComposedPress's `presses` listed)."""
    def built(value):
        if isinstance(value, dict):
            return build_press(value)
        return [built(item) for item in value] if isinstance(value, list) else value

    return getattr(kvpress, spec["class"])(**{key: built(value) for key, value in spec.items() if key != "class"})


def set_compression_ratio(press, ratio: float) -> None:
    """Give `press` (each press of a ComposedPress) the ratio of entries it drops; ThinKPress drops none (it prunes
    key channels at its own ratio, and refuses another)."""
    if isinstance(press, kvpress.ComposedPress):
        for inner in press.presses:
            set_compression_ratio(inner, ratio)
    elif not isinstance(press, kvpress.ThinKPress):
        press.compression_ratio = ratio


def compression_ratio(press, kept: int, prompt: int, slots: int) -> float:
    """The ratio at which `press` keeps `kept` entries per head of a `prompt`-token prompt: kvpress keeps
    int(prompt x (1 - ratio)) (ChunkKV: int(chunks x (1 - ratio)) chunks), KVzip prunes int(ratio x slots) of the
    `slots` = layers x heads x prompt entries; a hair of slack keeps the float product off the integer below."""
    if isinstance(press, kvpress.KVzipPress):
        return (prompt - kept) / prompt + 1e-9
    return 1 - kept / prompt - 1e-9


def local_pattern(folder: Path):
    """DuoAttentionPress's `load_attention_pattern`, reading `folder` (parity.prepare's) instead of the DuoAttention
    repository: its sink and recent sizes and its gates, clipped as kvpress clips the downloaded ones."""
    def load(model):
        window = json.loads((folder / "config.json").read_text())
        gates = np.clip(np.loadtxt(folder / "full_attention_heads.tsv", dtype=float, delimiter="\t"), 0, 1)
        return window["sink_size"], window["recent_size"], gates
    return load


def load_artifact(press, method: str, folder: Path) -> None:
    """Make `press` (or the press it wraps: DMSPress's) read kvbench's calibration in `folder`, saved in kvpress's own
    format, instead of its hub download: QFilterPress's `nthngdy/*_qfilt`, KVzapPress's `nvidia/KVzap-*`,
    ExpectedAttentionStatsPress's `alessiodevoto/exp_att_stats_*`."""
    inner = getattr(press, "press", press)
    if method == "qfilter":
        filters = kvpress.presses.qfilter_press.QFilters.from_pretrained(folder).q_filters
        inner.load_q_filters = lambda model_name: filters
    elif method == "expected-attention":
        inner.stats_folder = str(folder)
    else:  # kvzap-linear, kvzap-mlp: the folder KVzapModel.from_pretrained loads, in place of the hub name's
        surrogate = kvpress.presses.kvzap_press.KVzapModel.from_pretrained(folder)
        inner.post_init_from_model = lambda model: setattr(inner, "kvzap_model", surrogate)


def prompt_keys(model, ids: torch.Tensor) -> list[torch.Tensor]:
    cache = DynamicCache()
    model(input_ids=ids, past_key_values=cache)
    return [layer.keys[0] for layer in cache.layers]


def kept_channels(cache) -> list[torch.Tensor]:
    """Per layer, a `[kv_heads, head_dim]` mask of the key channels ThinKPress kept: those not zeroed in every kept
    key (a kept channel is zero throughout by chance with probability ~0)."""
    return [(layer.keys[0] != 0).any(dim=1) for layer in cache.layers]


def held_positions(model, cache, full_keys: list[torch.Tensor]) -> list[torch.Tensor]:
    masks = []
    for index, layer in enumerate(model.model.layers):
        full = full_keys[index]  # [kv_heads, n, D]
        masked = getattr(layer.self_attn, "masked_key_indices", None)
        mask = torch.zeros(full.shape[:2], dtype=torch.bool)
        if masked is not None:
            mask[:] = True
            _, heads, positions = masked
            mask[heads, positions] = False
        else:
            kept = cache.layers[index].keys[0]  # [kv_heads, m, D]
            for head in range(full.shape[0]):
                distance = torch.cdist(kept[head], full[head], compute_mode="donot_use_mm_for_euclid_dist")
                nearest = distance.min(dim=-1)
                mask[head, nearest.indices] = True
                if nearest.values.max() > 0 or int(mask[head].sum()) != kept.shape[1]:
                    raise SystemExit(f"parity: layer {index} head {head}: a kept key is not one of the prompt's")
        masks.append(mask)
    return masks


@torch.inference_mode()
def main(work: Path, cases: list[str] | None = None) -> None:
    transformers.utils.logging.disable_progress_bar()
    logging.getLogger("kvpress").setLevel(logging.ERROR)  # KVzip's note on its cost, once per prompt
    config = yaml.safe_load(CASES.read_text())
    if cases:
        config["cases"] = [case for case in config["cases"] if case["name"] in cases]
    prompts = json.loads((work / "prompts.json").read_text())
    results: dict = {}
    for spec in config["models"]:
        name = spec["name"]
        model = AutoModelForCausalLM.from_pretrained(work / "models" / name, dtype=torch.float32,
                                                     attn_implementation="sdpa").eval()
        results[name] = {}
        for prompt in prompts[name]:
            ids = torch.tensor([prompt])
            full_keys = prompt_keys(model, ids)
            n, slots = len(prompt), model.config.num_hidden_layers * model.config.num_key_value_heads * len(prompt)
            for case in config["cases"]:
                press = build_press(case["kvpress"])
                if "calibrated" in case:
                    load_artifact(press, case["calibrated"], artifact_folder(work, case, name))
                if "pattern" in case:  # the press decides its own counts from its pattern
                    press.load_attention_pattern = local_pattern(pattern_folder(work, case, name))
                elif "threshold" not in case and not case.get("press_counts"):  # else the press decides its counts:
                    # a threshold press (DMSPress) by its threshold, others by their own parameters (SimLayerKV)
                    set_compression_ratio(press, compression_ratio(press, kept_per_head(config, n, case), n, slots))
                for layer in model.model.layers:
                    layer.self_attn.masked_key_indices = None
                cache = DynamicCache()
                with press(model):
                    model(input_ids=ids, past_key_values=cache)
                kept = kept_channels(cache) if case["agreement"] == "channels" else \
                    held_positions(model, cache, full_keys)
                results[name].setdefault(case["name"], []).append(kept)
            print(f"parity: kvpress {version('kvpress')} on {name}, {n} tokens: {len(config['cases'])} presses",
                  flush=True)
    torch.save(results, work / "kvpress.pt")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("work", type=Path)
    parser.add_argument("--case", action="append", help="only this case (repeatable), as parity.compare takes")
    args = parser.parse_args()
    main(args.work, args.case)
