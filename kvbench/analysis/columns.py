"""Every record and summary column, declared once: its unit, what produces it, how the summary aggregates it, how
tables show it, which way is better and what the gate does with it, and its axis label in figures. The summary,
tables, report, gate and plot read this table; adding a column is an entry here and the code that produces it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvbench.engine.estimate import human_bytes

# how the summary turns a cell's records into its row (None: the records keep the column, the summary does not)
# ("service": taken from a load cell's status, what its service measured as a whole: kvbench/serving/)
AGGREGATES = ("mean", "mean_ci", "min", "max", "paired", "score", "service")
# what the gate does with a column: keeps it in the baseline (`kept`), fails on a relative rise (`memory`), on a
# fall of its ratio to full's in the same run (`speed`), on a paired per-sample rise (`fidelity`)
GATE_ROLES = ("kept", "memory", "speed", "fidelity")


@dataclass(frozen=True)
class Display:
    """A column in one rendered table: its heading and how a value reads (`value * scale` through a format spec,
    or `bytes` / `duration`, then `suffix`)."""

    heading: str
    spec: str
    scale: float = 1.0
    suffix: str = ""
    when_above: float | None = None  # shown only where some row's value exceeds this (batch: where one batched)

    def text(self, value: Any) -> str:
        if self.spec == "bytes":
            return human_bytes(value)
        if self.spec == "duration":  # `57.7 ms`, `4.73 s`
            return f"{value * 1000:.3g} ms" if value < 1 else f"{value:.3g} s"
        return format(value if self.scale == 1 else value * self.scale, self.spec) + self.suffix


@dataclass(frozen=True)
class Column:
    name: str
    unit: str
    producer: str  # the module (under kvbench.) that writes it into a record; `analysis.summary`: derived there
    aggregate: str | None = None  # one of AGGREGATES
    source: str | None = None  # the record column aggregated, where not `name` (cache_ratio_min: cache_ratio)
    missing: float | None = None  # what a record without it counts as (None: left out)
    better: str | None = None  # "higher" / "lower": the gate's direction and the LaTeX table's bold
    gate: str | None = None  # one of GATE_ROLES
    axis: str = ""  # a figure's axis label
    shown: dict[str, Display] = field(default_factory=dict)  # view -> how it reads there (see VIEWS)

    @property
    def record_key(self) -> str:
        return self.source or self.name


def _ratio(heading: str = "cache ratio") -> dict[str, Display]:
    return {"markdown": Display(heading, ".3f"), "terminal": Display(heading, ".3f"),
            "html": Display(heading, ".3g"), "latex": Display(heading, ".2f")}


# the load percentiles the markdown tables show
SHOWN_PERCENTILES = {("ttft", 99): Display("ttft p99 s", ".2f", when_above=-1),
                     ("tpot", 50): Display("tpot p50 ms", ".0f", 1000, when_above=-1)}

# the summary's columns in summary.csv's order, then what records hold that the summary leaves alone
COLUMNS = [
    Column("score", "task's unit", "tasks", "score", better="higher",
           shown={"latex": Display("score", ".2f")}),
    Column("cache_ratio", "fraction", "engine.measurements", "mean", better="lower", gate="kept",
           axis="cache ratio (kept / full KV bytes)", shown=_ratio()),
    Column("kv_bytes_live", "bytes", "engine.accounting", "mean", axis="KV cache held (MiB)",
           shown={"terminal": Display("kv live", "bytes")}),
    Column("kv_bytes_peak", "bytes", "engine.accounting", "mean", better="lower", gate="memory",
           axis="peak KV cache (MiB)",
           shown={"markdown": Display("kv peak MiB", ".1f", 2**-20), "terminal": Display("kv peak", "bytes"),
                  "html": Display("KV peak", "bytes"), "latex": Display("kv peak (MiB)", ".2f", 2**-20),
                  "gate": Display("kv peak", "+.1%")}),
    Column("read_ratio", "fraction", "engine.measurements", "mean",
           axis="read ratio (K/V bytes read per decode step / full's)",
           shown={"markdown": Display("read ratio", ".3f"), "terminal": Display("read ratio", ".3f")}),
    Column("kv_bytes_read", "bytes", "engine.accounting", "mean", axis="K/V read per decode step (MiB)"),
    Column("kv_bytes_read_full", "bytes", "engine.accounting", "mean"),
    Column("ttft_s", "s", "engine.measurements", "mean", better="lower", axis="time to first token (s)",
           shown={"markdown": Display("ttft s", ".2f"), "terminal": Display("ttft s", ".2f"),
                  "html": Display("TTFT", "duration"), "latex": Display("TTFT (s)", ".2f")}),
    Column("tpot_s", "s", "engine.measurements", "mean", better="lower",
           shown={"markdown": Display("tpot ms", ".0f", 1000), "terminal": Display("tpot ms", ".0f", 1000),
                  "html": Display("per token", "duration"), "latex": Display("TPOT (ms)", ".2f", 1000)}),
    Column("decode_tok_s", "tokens/s", "engine.measurements", "mean", better="higher", gate="speed",
           axis="decode tokens/s"),
    Column("prefill_tok_s", "tokens/s", "engine.measurements", "mean", better="higher", gate="speed"),
    Column("mem_peak_alloc", "bytes", "engine.measurements", "mean", axis="peak process / allocator memory (MiB)"),
    # a threshold keeps each sample's own share: the spread over the samples (figures draw it)
    Column("cache_ratio_min", "fraction", "analysis.summary", "min", source="cache_ratio"),
    Column("cache_ratio_max", "fraction", "analysis.summary", "max", source="cache_ratio"),
    # fidelity to the full cache, where a sweep asked for it: means with bootstrap CIs
    Column("kl_mean", "nats per step", "engine.fidelity", "mean_ci", better="lower", gate="fidelity",
           axis="KL(full || policy), nats per step", shown={"html": Display("KL", ".3g")}),
    Column("kl_max", "nats", "engine.fidelity", "mean_ci"),
    Column("top1_agreement", "fraction", "engine.fidelity", "mean_ci",
           shown={"html": Display("top-1 agreement", ".3g", 100, "%")}),
    Column("attn_recall", "fraction", "engine.fidelity", "mean_ci", axis="attention recall (full's mass kept)",
           shown={"html": Display("attention recall", ".3g", 100, "%")}),
    Column("first_divergence", "tokens", "engine.fidelity", "mean_ci"),
    # where a task names units in its prompt (few-shot examples, a system prompt's rules): the shares of them eviction
    # split (kept in part, in some layer and KV head) and dropped whole
    Column("segments_split", "fraction", "engine.segments", "mean_ci", better="lower",
           shown={"markdown": Display("split", ".2f", when_above=0), "html": Display("segments split", ".0%"),
                  "reason": Display("of the examples or rules split", ".0%")}),
    Column("segments_dropped", "fraction", "engine.segments", "mean_ci", better="lower",
           shown={"reason": Display("of the examples or rules dropped whole", ".0%")}),
    # the instructions task: the share of its system prompt a request to repeat it gets back
    Column("leak", "fraction", "tasks.instructions", "mean_ci", better="lower",
           shown={"markdown": Display("leak", ".2f", when_above=0), "html": Display("system prompt leaked", ".0%"),
                  "reason": Display("of the system prompt leaked", ".0%")}),
    Column("budget_tokens", "tokens", "engine.session", "mean"),
    # the most samples it decoded together: its times and tokens/s are that batch's (records before batching: one)
    Column("batch_size", "sequences", "engine.session", "max", missing=1,
           shown={"markdown": Display("batch", ".0f", when_above=1), "html": Display("batch", ".0f", when_above=1)}),
    # from pairs of cells: generated tokens over full's on the same samples, the score's paired change
    Column("length_ratio", "ratio", "analysis.summary", "paired",
           shown={"markdown": Display("length ×", ".2f", when_above=0),
                                                                "html": Display("length ratio", ".3g", suffix="×")}),
    # the tails a mean length ratio hides: the shares of samples whose answer ran >= 1.5x or <= 0.67x full's (shown
    # where some cell has one)
    Column("length_longer", "fraction", "analysis.summary", "paired", better="lower",
           shown={"markdown": Display("≥1.5× len", ".2f", when_above=0), "html": Display("≥1.5× longer", ".0%"),
                  "reason": Display("of the answers ≥1.5× full's length", ".0%")}),
    Column("length_shorter", "fraction", "analysis.summary", "paired", better="lower",
           shown={"markdown": Display("≤0.67× len", ".2f", when_above=0), "html": Display("≤0.67× shorter", ".0%"),
                  "reason": Display("of the answers ≤0.67× full's length", ".0%")}),
    Column("delta_vs_full", "task's unit", "analysis.summary", "paired", better="higher",
           shown={"latex": Display(r"$\Delta$ vs full", ".2f")}),
    # a load cell's service as a whole (kvbench/serving/), shown where a run has one
    Column("goodput", "requests/s", "serving.metrics", "service", better="higher",
           axis="goodput (requests/s within the SLO)",
           shown={"markdown": Display("goodput/s", ".2f", when_above=-1), "html": Display("goodput/s", ".3g",
                                                                                         when_above=-1)}),
    Column("request_rate", "requests/s", "serving.metrics", "service", better="higher",
           shown={"markdown": Display("done/s", ".2f", when_above=-1)}),
    Column("output_tok_s", "tokens/s", "serving.metrics", "service", better="higher"),
    Column("slo_attained", "fraction", "serving.metrics", "service", better="higher"),
    *(Column(f"{name}_p{q}", "s", "serving.metrics", "service", better="lower",
             axis=f"p{q} {label} (s)" if q == 99 else "",
             shown={"markdown": SHOWN_PERCENTILES[name, q]} if (name, q) in SHOWN_PERCENTILES else {})
      for name, label in (("ttft", "time to first token"), ("tpot", "time per output token"), ("e2e", "latency"),
                          ("queue", "queue wait")) for q in (50, 90, 99)),
    Column("load_rate", "requests/s", "analysis.summary", axis="arrival rate (requests/s)"),
    Column("rate_searched", "bool", "analysis.summary"),
    Column("load_attainment", "fraction", "analysis.summary"),
    # `rates: auto`: the highest Poisson rate at which the cell's attainment of requests met the SLO (NaN: none)
    Column("sustained_rate", "requests/s", "runs.load_cell", "service", better="higher",
           shown={"markdown": Display("sustained/s", ".3g", when_above=-1)}),
    Column("missed_rate", "requests/s", "runs.load_cell", "service"),  # a search's lowest rate that did not hold
    Column("concurrency_mean", "requests", "serving.metrics", "service",
           shown={"markdown": Display("running", ".1f", when_above=-1)}),
    Column("concurrency_peak", "requests", "serving.metrics", "service"),
    Column("rejected", "requests", "serving.metrics", "service", better="lower",
           shown={"markdown": Display("rejected", ".0f", when_above=0)}),
    Column("preemptions", "requests", "serving.metrics", "service", better="lower",
           shown={"markdown": Display("preempted", ".0f", when_above=0)}),
    Column("offered", "requests", "serving.metrics", "service"),
    Column("finished", "requests", "serving.metrics", "service"),
    Column("duration_s", "s", "serving.metrics", "service"),
    Column("pool_bytes", "bytes", "serving.metrics", "service"),
    # the pool's rows of static buffers and their bytes (NaN: the requests stepped jointly, as `pool_step` says why)
    Column("pool_rows", "requests", "serving.metrics", "service"),
    Column("pool_allocated", "bytes", "serving.metrics", "service"),
    Column("pool_step", "text", "serving.metrics", "service"),
    Column("pool_used_mean", "bytes", "serving.metrics", "service"),
    Column("pool_used_peak", "bytes", "serving.metrics", "service"),
    # a request's own times under load (its record's ttft_s and tpot_s are from its arrival, as vLLM's)
    Column("arrival_s", "s", "serving.requests"),
    Column("e2e_s", "s", "serving.requests"),
    Column("queue_s", "s", "serving.requests"),
    Column("times_preempted", "count", "serving.requests"),  # the request's own; its cell's total is `preemptions`
    Column("request", "index", "runs.load_cell"),
    Column("attempt", "id", "runs.sweep"),  # a load cell's run that wrote the record (a rerun after a kill is another)
    Column("generated_tokens", "tokens", "engine.measurements"),  # the summary pairs it into length_ratio
    Column("prompt_tokens", "tokens", "engine.measurements"),
    Column("kv_bytes_physical", "bytes", "engine.accounting"),
    Column("kv_bytes_full", "bytes", "engine.accounting"),
    Column("kv_bytes_peak_own", "bytes", "engine.measurements"),
    Column("kept_mean", "entries", "engine.accounting"),
    Column("kept_max", "entries", "engine.accounting"),
    Column("kept_max_ever", "entries", "engine.accounting"),
    Column("evictions", "entries", "engine.accounting"),
    Column("mem_peak_reserved", "bytes", "engine.measurements"),
    Column("mem_peak_device", "bytes", "engine.measurements"),
    Column("mem_group_peak_alloc", "bytes", "engine.measurements"),
    Column("mem_group_peak_reserved", "bytes", "engine.measurements"),
    Column("mem_group_peak_device", "bytes", "engine.measurements"),
    Column("mem_baseline", "bytes", "engine.measurements"),
    Column("mem_device_note", "text", "engine.measurements"),
    Column("prefill_shared", "bool", "engine.measurements"),
    Column("layer_kinds", "per layer", "engine.measurements"),
    Column("budget_scope", "text", "engine.session"),
    Column("kl_by_position", "nats per step", "engine.fidelity"),
    Column("attn_recall_by_layer", "fraction per layer", "engine.fidelity"),
    Column("nll_by_position", "nats per token", "tasks"),
    # what the cache kept of each unit a task names in its prompt (engine/segments.py): shares of (layer, KV head)
    Column("segments", "per segment", "engine.segments"),
    # the instructions task's reply to a request to repeat its rules
    Column("leak_answer", "text", "tasks.instructions"),
    # what the record is of: the cell and the sample (the summary reads them from the cell description)
    *(Column(name, "text", "runs.sweep") for name in ("cell_id", "cell", "dtype")),
    *(Column(name, "text", "runs.runner") for name in (
        "model", "task", "policy", "family", "budget", "context_length", "prefill", "prefill_chunk", "question",
        "evict_every", "seed", "sample_id", "scenario", "higher_is_better", "meta")),
    *(Column(name, "text", "tasks") for name in ("prediction", "references", "scores")),
]
BY_NAME = {column.name: column for column in COLUMNS}
# which columns each rendered table shows, in its order (a column's `shown` says how it reads there)
VIEWS = {
    "markdown": ("cache_ratio", "read_ratio", "kv_bytes_peak", "ttft_s", "tpot_s", "batch_size", "goodput",
                 "request_rate", "ttft_p99", "tpot_p50", "concurrency_mean", "rejected", "preemptions", "length_ratio",
                 "length_longer", "length_shorter", "segments_split", "leak"),
    "terminal": ("cache_ratio", "read_ratio", "kv_bytes_peak", "kv_bytes_live", "ttft_s", "tpot_s"),
    "sweep": ("cache_ratio", "read_ratio", "kv_bytes_peak"),
    "html": ("cache_ratio", "kv_bytes_peak", "ttft_s", "tpot_s", "batch_size", "goodput", "kl_mean", "top1_agreement",
             "attn_recall", "length_ratio", "length_longer", "length_shorter", "segments_split", "leak"),
    "latex": ("score", "delta_vs_full", "cache_ratio", "kv_bytes_peak", "ttft_s", "tpot_s"),
    # what a recommendation's reasoning names where the chosen cell holds more than full (each is lower-is-better;
    # kvbench/analysis/recommend.py)
    "reason": ("segments_split", "segments_dropped", "leak", "length_longer", "length_shorter"),
}


def column(name: str) -> Column:
    """The declaration of `name`; a KeyError names an undeclared column at once."""
    return BY_NAME[name]


def aggregated(kind: str) -> list[Column]:
    """The columns the summary aggregates as `kind`, in summary.csv's order."""
    return [c for c in COLUMNS if c.aggregate == kind]


def spread(name: str) -> tuple[str, str] | None:
    """The summary's (min, max) columns of column `name` over a cell's samples, where it has them."""
    low = next((c.name for c in aggregated("min") if c.record_key == name), None)
    high = next((c.name for c in aggregated("max") if c.record_key == name), None)
    return (low, high) if low and high else None


def gated(role: str) -> list[Column]:
    return [c for c in COLUMNS if c.gate == role]


def view(name: str) -> list[tuple[Column, Display]]:
    """The columns a rendered table shows, with how each reads there (`sweep` reads like `terminal`)."""
    shown_as = "terminal" if name == "sweep" else name
    return [(BY_NAME[key], BY_NAME[key].shown[shown_as]) for key in VIEWS[name]]
