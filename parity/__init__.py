"""kvbench against kvpress itself: parity.prepare, parity.run_kvpress (kvpress's environment), parity.compare."""


def kept_per_head(config: dict, prompt_tokens: int) -> int:
    """The entries each side keeps per layer and KV head of a prompt: `budget_ratio` of it, rounded down."""
    return int(config["budget_ratio"] * prompt_tokens)
