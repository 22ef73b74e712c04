"""kvbench against kvpress itself: parity.prepare, parity.run_kvpress (kvpress's environment), parity.compare."""


from pathlib import Path


def kept_per_head(config: dict, prompt_tokens: int, case: dict | None = None) -> int:
    """The entries each side keeps per layer and KV head of a prompt: the case's own `budget` when it fixes one
    (SimLayerKV: a lazy layer's size), else `budget_ratio` of the prompt, rounded down."""
    if case is not None and "budget" in case:
        return int(case["budget"])
    return int(config["budget_ratio"] * prompt_tokens)


def pattern_folder(work: Path, case: dict, model: str) -> Path:
    """Where parity.prepare writes `case`'s head pattern for `model` (full_attention_heads.tsv, config.json)."""
    return work / "patterns" / case["name"] / model


# a calibrated policy's parameter naming its artifact folder, by `calibrated:` method
ARTIFACT_PARAMS = {"qfilter": "filters", "kvzap-linear": "kvzap_model", "kvzap-mlp": "kvzap_model",
                   "expected-attention": "stats_folder"}


def artifact_folder(work: Path, case: dict, model: str) -> Path:
    """Where parity.prepare writes `case`'s calibrated artifact for `model` (`kvbench calibrate`'s folder)."""
    return work / "artifacts" / case["name"] / model
