"""Writes what both sides of the kvpress parity check read (kvbench's environment): every model of
parity/cases.yaml as a transformers folder without a chat template, and its prompts as token ids.

    python -m parity.prepare WORK     # WORK/models/<name>/, WORK/prompts.json
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

import torch
import transformers
import yaml
from transformers import AutoTokenizer

from kvbench.calibration.calibrate import calibrate
from kvbench.calibration.methods import SIZES
from kvbench.engine.models import load_model, local_source
from kvbench.tasks.corpus import load_corpus
from parity import artifact_folder, pattern_folder

CASES = Path(__file__).with_name("cases.yaml")
# random weights attend almost uniformly, where scores tie; peaked attention separates them, too peaked an attention
# underflows to ties again: 12 x each projection, or about 2 x a q/k norm's weight (its output is already of unit
# scale), drawn per channel as a trained norm's are (a norm of equal weights gives every key one length)
SHARPEN, SHARPEN_NORMED = 12.0, 2.0
SEED = 3
# a calibration small enough for CPU: 2 windows of 256 tokens of the embedded corpus through each model (its own
# tokenizer), all trained on: the parity check compares what both sides keep with one artifact, not its quality
CALIBRATION = {"documents": 2, "tokens": 256, "held_out": 0}


def random_model(shape: str, folder: Path) -> None:
    lm = load_model(f"random:{shape}", dtype="float32", device="cpu", seed=SEED)
    generator = torch.Generator().manual_seed(SEED)
    for layer in lm.model.model.layers:
        attention = layer.self_attn
        if hasattr(attention, "q_norm"):  # a q/k norm undoes any scaling of its projection
            for norm in (attention.q_norm, attention.k_norm):
                spread = torch.randn(norm.weight.shape, generator=generator)
                norm.weight.data = SHARPEN_NORMED * (1 + 0.3 * spread)
        else:
            for projection in (attention.q_proj, attention.k_proj):
                projection.weight.data.mul_(SHARPEN)
    lm.model.save_pretrained(folder)
    lm.tokenizer.save_pretrained(folder)


def linked_without_chat_template(source: Path, folder: Path) -> None:
    """`source`'s files linked into `folder`, its tokenizer without a chat template: KVzip's repeat request then
    ends in a newline on both sides, and kvpress finds no template prefix in a prompt that has none."""
    folder.mkdir(parents=True)
    for file in source.iterdir():
        if file.name == "tokenizer_config.json":
            config = json.loads(file.read_text())
            config.pop("chat_template", None)
            (folder / file.name).write_text(json.dumps(config))
        elif file.name != "chat_template.jinja":
            (folder / file.name).symlink_to(file.resolve())


def prompts_for(spec: dict, folder: Path) -> list[list[int]]:
    lengths = spec["prompts"]
    if "random" in spec:
        generator = torch.Generator().manual_seed(SEED)
        return [torch.randint(0, 256, (n,), generator=generator).tolist() for n in lengths]
    ids = AutoTokenizer.from_pretrained(folder).encode(load_corpus("embedded"), add_special_tokens=False)
    # prompts from different places of the corpus, none at its start
    return [ids[1000 * (i + 1) : 1000 * (i + 1) + n] for i, n in enumerate(lengths)]


def write_pattern(folder: Path, model: Path, window: dict) -> None:
    """A DuoAttention head pattern for `model` in the official layout: a random gate in [0, 1) per layer and KV head
    (distinct, so the heads' order is the same on both sides) and the streaming heads' window."""
    model_config = transformers.AutoConfig.from_pretrained(model)
    heads = getattr(model_config, "num_key_value_heads", None) or model_config.num_attention_heads
    gates = torch.rand(model_config.num_hidden_layers, heads, generator=torch.Generator().manual_seed(SEED))
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "full_attention_heads.tsv").write_text(
        "".join("\t".join(f"{gate:.6f}" for gate in layer) + "\n" for layer in gates.tolist()))
    (folder / "config.json").write_text(json.dumps(window))


def main(work: Path) -> None:
    transformers.utils.logging.disable_progress_bar()
    config = yaml.safe_load(CASES.read_text())
    prompts = {}
    for spec in config["models"]:
        folder = work / "models" / spec["name"]
        if not folder.exists():
            if "random" in spec:
                random_model(spec["random"], folder)
            else:
                linked_without_chat_template(Path(local_source(spec["embedded"])), folder)
        prompts[spec["name"]] = prompts_for(spec, folder)
        for case in config["cases"]:
            if "pattern" in case:
                write_pattern(pattern_folder(work, case, spec["name"]), folder, case["pattern"])
            if "calibrated" in case:  # kvbench's artifact, which both sides load
                lm = load_model(str(folder), dtype="float32", device="cpu")
                settings = replace(SIZES[case["calibrated"]][0], **CALIBRATION)
                calibrate(lm, case["calibrated"], "embedded", settings, artifact_folder(work, case, spec["name"]))
        print(f"parity: {spec['name']}: prompts of {[len(p) for p in prompts[spec['name']]]} tokens", flush=True)
    (work / "prompts.json").write_text(json.dumps(prompts))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("work", type=Path, help="the folder both sides read (models/, prompts.json)")
    main(parser.parse_args().work)
