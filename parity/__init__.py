"""kvbench against kvpress itself: parity.prepare, parity.run_kvpress (kvpress's environment), parity.compare."""


def kept_per_head(config: dict, prompt_tokens: int, case: dict | None = None) -> int:
    """The entries each side keeps per layer and KV head of a prompt: the case's own `budget` when it fixes one
    (SimLayerKV: a lazy layer's size), else `budget_ratio` of the prompt, rounded down."""
    if case is not None and "budget" in case:
        return int(case["budget"])
    return int(config["budget_ratio"] * prompt_tokens)
