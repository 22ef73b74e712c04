"""Sweep configs: YAML -> a validated `SweepConfig`, with `include:` and `--set` overrides.

Every error names the file, the line and the key, as one line (KvbenchError).
"""

from __future__ import annotations

import hashlib
import json
import logging
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import pydantic
import yaml
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from kvbench.config.files import assign, dotted, model_spec, named_spec, read_with_includes, where_given
from kvbench.engine.settings import check_budget
from kvbench.errors import KvbenchError, did_you_mean
from kvbench.policies.budgets import THRESHOLD, Threshold, budget_description, threshold_from

# a budget as a config writes it: tokens per layer and KV head, a ratio of the prompt, or {threshold: t}
BudgetSpec = int | float | dict[str, float]

# an integer budget this small is more likely a ratio written without its decimal point than a real token count
RATIO_LIKE_BELOW = 16


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ModelConfig(Strict):
    id: str = "smollm2-135m"
    dtype: str = "auto"
    device: str = "auto"
    device_map: str | None = None

    @field_validator("dtype")
    @classmethod
    def _dtype(cls, dtype: str) -> str:
        return _checked_dtype(dtype)

    def identity(self) -> dict[str, str]:
        """What of the model changes results, as cells describe it: its id and dtype (not where it runs)."""
        return {"id": self.id, "dtype": self.dtype}


class PrefillConfig(Strict):
    mode: Literal["full", "chunked"] = "full"
    chunk: int = Field(512, gt=0)


class NamedSpec(BaseModel):
    """`name` plus free parameters (checked against the policy's or task's own fields later)."""

    model_config = ConfigDict(extra="allow")
    name: str

    @property
    def params(self) -> dict[str, Any]:
        return dict(self.model_extra or {})

    def canonical(self) -> dict[str, Any]:
        return {"name": self.name, "params": dict(sorted(self.params.items()))}


class TimingConfig(Strict):
    """Speed cells: each sample runs `warmup` times unmeasured, then `repeats` times; records keep the median."""

    warmup: int = Field(1, ge=0)
    repeats: int = Field(3, ge=1)


class SloConfig(Strict):
    """What a good request meets under load: time to its first token, time per output token after it."""

    ttft_s: float | None = Field(None, gt=0)
    tpot_s: float | None = Field(None, gt=0)


# a rate is sustained when at least this share of its offered requests finished within the SLO (vLLM's and DistServe's
# attainment)
DEFAULT_ATTAINMENT = 0.9


class RateSearch(Strict):
    """How `rates: auto` looks for the highest rate sustained: from `start` requests/s, doubling while a rate holds
    (up to `limit`), then `refine` halvings of the gap between the last rate that held and the first that did not."""

    start: float = Field(0.1, gt=0)
    limit: float = Field(12.8, gt=0)
    refine: int = Field(2, ge=0, le=8)


class LoadConfig(Strict):
    """Cells under load (kvbench/serving/), one per arrival rate (Poisson, requests/s) or closed loop of `users`, or
    one replaying a `trace` file: `requests` drawn from the task's samples (a trace's: one per line) share a KV pool
    (`kv_pool`: bytes as `512MiB`, or `4096 tokens` of the model's full cache; or `pressure`, a share of the GPU
    memory free when the cell starts). `rates: auto` makes one cell per setting that searches for the highest
    Poisson rate at which at least `attainment` of the requests meet the SLO (`search`)."""

    rates: list[float] | Literal["auto"] | None = None
    users: list[int] | None = Field(None, min_length=1)
    trace: str | None = None  # JSON lines: arrival_s, and optionally prompt and max_tokens
    requests: int = Field(32, gt=0)
    kv_pool: str | None = None
    pressure: float | None = Field(None, gt=0, le=1)
    slo: SloConfig = SloConfig()
    timeout_s: float | None = Field(None, gt=0)
    max_queue: int | None = Field(None, gt=0)
    horizon_s: float | None = Field(None, gt=0)
    attainment: float = Field(DEFAULT_ATTAINMENT, gt=0, le=1)  # the share of requests within the SLO that holds a rate
    search: RateSearch = RateSearch()

    @model_validator(mode="after")
    def _arrivals(self) -> LoadConfig:
        if sum(given is not None for given in (self.rates, self.users, self.trace)) != 1:
            raise ValueError("give 'rates' (Poisson arrivals, requests/s), 'users' (a closed loop) or 'trace' (a "
                             "file of arrivals), one of them")
        if self.trace is not None:
            from kvbench.serving import read_trace

            _checked(read_trace, self.trace)
        listed = self.rates if isinstance(self.rates, list) else []
        if self.rates == [] or any(rate <= 0 for rate in listed) or any(users < 1 for users in self.users or []):
            raise ValueError(f"rates must be positive and users at least 1, got {self.rates or self.users}")
        if self.rates == "auto" and self.slo.ttft_s is None and self.slo.tpot_s is None:
            raise ValueError("rates: auto searches for the rate sustained at the SLO: give slo.ttft_s or slo.tpot_s")
        if self.search.start > self.search.limit:
            raise ValueError(f"search.start {self.search.start:g} is above search.limit {self.search.limit:g}")
        if self.kv_pool is not None and self.pressure is not None:
            raise ValueError("give 'kv_pool' or 'pressure', not both")
        if self.kv_pool is not None:
            from kvbench.serving import pool_spec

            _checked(pool_spec, self.kv_pool)
        return self

    def conditions(self) -> list[dict[str, Any]]:
        """Each load cell's `load` description: its arrivals, and what every cell of the sweep shares."""
        from kvbench.serving import read_trace

        # a search's own settings name the cells that read them: a search's, and any whose config gives them
        unread = set() if self.rates == "auto" else {"attainment", "search"} - self.model_fields_set
        shared = self.model_dump(exclude={"rates", "users", "trace", *unread})
        # a trace is named by its content too, so an edited trace is a new cell
        traced = [] if self.trace is None else [{"trace": self.trace, "trace_sha256": _file_digest(self.trace),
                                                  **shared, "requests": len(read_trace(self.trace))}]
        rates: list[float | str] = ["auto"] if self.rates == "auto" else list(self.rates or [])
        return [{"rate": rate, **shared} for rate in rates] + \
            [{"users": users, **shared} for users in self.users or []] + traced


def _file_digest(path: str) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()[:16]


class PolicySpec(NamedSpec):
    """A policy; `budgets:` (or `budget:`) gives it its own budgets instead of the sweep's, e.g. to set a
    hybrid policy beside a compression one at equal bytes."""

    budgets: list[BudgetSpec] | None = Field(None, min_length=1)

    @field_validator("budgets", mode="before")
    @classmethod
    def _percent_budgets(cls, value: Any) -> Any:
        return _parsed_budgets(value)

    @model_validator(mode="before")
    @classmethod
    def _one_budget(cls, value: Any) -> Any:
        if isinstance(value, dict) and "budget" in value:
            if "budgets" in value:
                raise ValueError("give 'budget' or 'budgets', not both")
            value = {**value, "budgets": [value["budget"]]}
            del value["budget"]
        return value

    @field_validator("budgets")
    @classmethod
    def _budgets(cls, budgets: list[BudgetSpec] | None) -> list[BudgetSpec] | None:
        _check_budgets(budgets or [])
        return budgets


class TaskSpec(NamedSpec):
    samples: int | None = Field(None, gt=0)  # this task's samples, instead of the sweep's


def _checked_dtype(dtype: str) -> str:
    """`dtype` by its full name (`bf16` is `bfloat16`, in cells and the config hash too), checked."""
    from kvbench.engine.estimate import DTYPE_ALIASES, canonical_dtype
    from kvbench.engine.models import DTYPES

    dtype = canonical_dtype(dtype)
    if dtype != "auto" and dtype not in DTYPES:
        raise ValueError(f"unknown dtype '{dtype}' (use auto, {', '.join(DTYPES)}; or {', '.join(DTYPE_ALIASES)})")
    return dtype


class SweepConfig(Strict):
    name: str
    # folders of policy/task files to import (as `--plugins DIR`), relative to the config file that names them
    plugins: list[str] = []
    model: ModelConfig = ModelConfig()
    # robustness axes: several models (each loaded once, swept in turn) instead of `model`, and dtypes crossing them
    models: list[ModelConfig] | None = Field(None, min_length=1)
    dtypes: list[str] | None = Field(None, min_length=1)
    policies: list[PolicySpec] = Field(min_length=1)
    # tokens per layer and KV head, ratios of the prompt, or {threshold: t} (policies/budgets.py)
    budgets: list[BudgetSpec] = Field(min_length=1)
    context_lengths: list[int] = Field(min_length=1)
    tasks: list[TaskSpec] = Field(min_length=1)
    prefill: PrefillConfig = PrefillConfig()
    question: list[Literal["aware", "agnostic"]] = ["aware"]
    samples: int = Field(3, gt=0)
    seed: int = 0
    evict_every: int = Field(1, gt=0)
    max_new_tokens: int | None = Field(None, gt=0)
    # samples of a cell decoded together (left-padded): changes how fast, never what a record says
    batch_size: int = Field(1, gt=0)
    # decode steps compiled into one graph (CUDA graphs on a GPU): changes how fast, not what a record says
    compile: bool = False
    timing: TimingConfig | None = None
    # per-sample diagnostics: `fidelity` runs a full cache in lockstep and records how far the policy's is from it
    diagnostics: list[Literal["fidelity"]] = []
    # memory-pressure cells: the share of device memory already taken, or the memory the run may use
    pressure: list[float] | None = None
    memory_limit: str | None = None
    # a service under load: requests arriving while others decode, in a pool of KV memory (kvbench/serving/)
    load: LoadConfig | None = None
    output: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _model_or_models(cls, value: Any) -> Any:
        if isinstance(value, dict) and "model" in value and "models" in value:
            raise _Located(("models",), "give 'model' or 'models', not both")
        return value

    @field_validator("model", mode="before")
    @classmethod
    def _model_id(cls, value: Any) -> Any:
        return model_spec(value)

    @field_validator("models", mode="before")
    @classmethod
    def _model_ids(cls, value: Any) -> Any:
        return [model_spec(item) for item in value] if isinstance(value, list) else value

    @field_validator("dtypes")
    @classmethod
    def _dtypes(cls, dtypes: list[str] | None) -> list[str] | None:
        return None if dtypes is None else [_checked_dtype(dtype) for dtype in dtypes]

    @model_validator(mode="after")
    def _one_dtype_source(self) -> SweepConfig:
        """`dtypes` crosses every model, so a model's own dtype would be silently overridden: refuse it."""
        if self.dtypes:
            named = [(("models", i, "dtype"), m) for i, m in enumerate(self.models)] if self.models else \
                [(("model", "dtype"), self.model)]
            for loc, model in named:
                if model.dtype != "auto":
                    raise _Located(loc, f"dtype '{model.dtype}' conflicts with 'dtypes' (which crosses every "
                                        "model): give one or the other")
        return self

    def model_grid(self) -> list[ModelConfig]:
        """Every (model, dtype) the sweep runs, in config order: `models` (or the one `model`) x `dtypes`."""
        grid: dict[tuple[str, str], ModelConfig] = {}
        for model in self.models or [self.model]:
            for dtype in self.dtypes or [model.dtype]:
                variant = model.model_copy(update={"dtype": dtype})
                grid.setdefault((variant.id, variant.dtype), variant)  # listed twice: runs once
        return list(grid.values())

    @field_validator("policies", "tasks", mode="before")
    @classmethod
    def _names(cls, value: Any) -> Any:
        return [named_spec(item) for item in value] if isinstance(value, list) else value

    @field_validator("question", mode="before")
    @classmethod
    def _one_or_many(cls, value: Any) -> Any:
        return [value] if isinstance(value, str) else value

    @field_validator("plugins")
    @classmethod
    def _load_plugins(cls, folders: list[str]) -> list[str]:
        """Imported while validating, so that `_registered` below finds the names they register."""
        from kvbench.registry import load_plugins

        for folder in folders:
            _checked(load_plugins, folder)
        return folders

    @field_validator("budgets", mode="before")
    @classmethod
    def _percent_budgets(cls, value: Any) -> Any:
        return _parsed_budgets(value)

    @field_validator("budgets")
    @classmethod
    def _budgets(cls, budgets: list[BudgetSpec]) -> list[BudgetSpec]:
        _check_budgets(budgets)
        return budgets

    @field_validator("pressure")
    @classmethod
    def _pressure(cls, levels: list[float] | None) -> list[float] | None:
        if levels is not None and (not levels or any(not 0 <= p < 1 for p in levels)):
            raise ValueError(f"pressure levels are fractions of memory already taken, in [0, 1): got {levels}")
        return levels

    @field_validator("memory_limit")
    @classmethod
    def _memory_limit(cls, limit: str | None) -> str | None:
        from kvbench.engine.estimate import parse_bytes

        if limit is not None:
            _checked(parse_bytes, limit)
        return limit

    @field_validator("context_lengths")
    @classmethod
    def _lengths(cls, lengths: list[int]) -> list[int]:
        if any(length <= 0 for length in lengths):
            raise ValueError(f"context lengths must be positive, got {lengths}")
        return lengths

    @model_validator(mode="after")
    def _registered(self) -> SweepConfig:
        from kvbench.policies import POLICIES
        from kvbench.policies.base import Demand, takes_budget
        from kvbench.tasks import TASKS

        for field, registry in (("policies", POLICIES), ("tasks", TASKS)):
            for index, spec in enumerate(getattr(self, field)):
                try:
                    built = registry.build(spec.name, spec.params)
                except KvbenchError as exc:
                    raise _Located((field, index, "name"), str(exc)) from None
                if field == "tasks":
                    try:
                        built.check_lengths(self.context_lengths)
                    except KvbenchError as exc:  # the task's own spec, or its lengths: the message says which
                        raise _Located((field, index), str(exc)) from None
                if field == "policies":
                    chunked = self.prefill.mode == "chunked"
                    try:
                        built.check(Demand(chunked=chunked))
                    except KvbenchError as exc:
                        raise _Located((field, index, "name"), str(exc)) from None
                    for budget in spec.budgets or self.budgets:
                        tokens = budget if isinstance(budget, int) else None
                        threshold = threshold_from(budget) is not None
                        if takes_budget(built) and (tokens is not None or threshold):
                            try:  # a policy cannot take thresholds at all, or cannot take this token count
                                built.check(Demand(tokens, threshold, chunked))
                            except KvbenchError as exc:
                                where = ("budgets",) if tokens is not None else (field, index, "name")
                                raise _Located(where, str(exc)) from None
        return self

    @model_validator(mode="after")
    def _load_alone(self) -> SweepConfig:
        if self.load is None:
            return self
        for key in ("timing", "pressure", "memory_limit", "diagnostics"):
            if getattr(self, key):
                raise _Located(("load",), f"load cells time and measure a service: '{key}' does not combine with them")
        from kvbench.tasks import TASKS

        for index, spec in enumerate(self.tasks):
            if not TASKS.build(spec.name, spec.params).batches:
                raise _Located(("tasks", index, "name"), f"task '{spec.name}' runs each sample its own way: under "
                               "load kvbench serves tasks that answer one prompt")
        return self

    def all_budgets(self) -> list[BudgetSpec]:
        """The sweep's budgets and every policy's own."""
        return [*self.budgets, *(budget for policy in self.policies for budget in policy.budgets or [])]

    def result_hash(self) -> str:
        """Identifies everything that changes results (not where they are written or on which device)."""
        relevant = self.model_dump(exclude={"output", "name", "model", "models", "dtypes", "plugins", "batch_size",
                                            "compile"})
        grid = [model.identity() for model in self.model_grid()]
        # one model hashes as `model:` did before `models:`/`dtypes:` existed, so its baselines stay valid
        if len(grid) == 1:
            relevant["model"] = grid[0]
        else:
            relevant["models"] = grid
        # options added later count only when set, so older configs keep their hash (and their baselines)
        for task in relevant["tasks"]:
            if task["samples"] is None:
                del task["samples"]
        for policy in relevant["policies"]:
            if policy["budgets"] is None:
                del policy["budgets"]
        for key in ("timing", "pressure", "memory_limit", "load"):
            if relevant[key] is None:
                del relevant[key]
        if not relevant["diagnostics"]:
            del relevant["diagnostics"]
        return hashlib.sha256(json.dumps(relevant, sort_keys=True, default=str).encode()).hexdigest()[:16]


def budget_from_text(text: str) -> int | float | Threshold:
    """`128` (tokens per layer and KV head), `0.25` or `25%` (a ratio of the prompt), or `threshold=0.01` (a
    threshold on the policy's normalised score), checked."""
    text = text.strip()
    not_a_budget = f"budget '{text}' is not a number (128 tokens), a ratio (0.25 or 25%) or threshold=0.01"
    try:
        if text.startswith(f"{THRESHOLD}="):
            return Threshold(float(text.removeprefix(f"{THRESHOLD}=")))
        if text.endswith("%"):
            percent = float(text.removesuffix("%"))
            if not 0 < percent <= 100:
                raise KvbenchError(f"budget '{text}': a percentage of the prompt must be in (0%, 100%]")
            value: int | float = percent / 100
        else:
            try:
                value = int(text)
            except ValueError:
                value = float(text)
    except ValueError:
        raise KvbenchError(not_a_budget) from None
    check_budget(value)
    return value


def warn_if_ratio_like(budget: int | float | Threshold | None) -> None:
    """One line on stderr (through logging) for an integer budget under RATIO_LIKE_BELOW: `1` is one token,
    `1.0` the whole prompt."""
    if isinstance(budget, int) and not isinstance(budget, bool) and 0 < budget < RATIO_LIKE_BELOW:
        logging.getLogger(__name__).warning(
            f"warning: budget {budget} is {budget} token{'s' if budget > 1 else ''} per layer and KV head, not a "
            "ratio of the prompt (a ratio is written 0.25 or 25%, the whole prompt 1.0 or 100%)")


def _parsed_budgets(value: Any) -> Any:
    """Budgets written as text in YAML (`25%`, `threshold=0.01`) become numbers or `{threshold: t}`, and a
    `{threshold: t}` is checked; everything else is left to pydantic."""
    if not isinstance(value, list):
        return value
    parsed = []
    for budget in value:
        try:
            if isinstance(budget, str):
                budget = budget_description(budget_from_text(budget))
            elif isinstance(budget, dict):
                budget = budget_description(threshold_from(budget))
        except KvbenchError as exc:
            raise ValueError(str(exc)) from None
        parsed.append(budget)
    return parsed


def _check_budgets(budgets: list[BudgetSpec]) -> None:
    for budget in budgets:
        if not isinstance(budget, dict):  # a threshold was checked as it was parsed
            _checked(check_budget, budget)


def _checked(check, value: Any) -> None:
    """Run a kvbench check inside a pydantic validator, which reports ValueErrors with their location."""
    try:
        check(value)
    except KvbenchError as exc:
        raise ValueError(str(exc)) from None


class _Located(Exception):  # not a ValueError: pydantic must let it through with its location
    def __init__(self, loc: tuple, message: str) -> None:
        super().__init__(message)
        self.loc = loc


def load_config(path: str | Path, overrides: Sequence[str] = ()) -> SweepConfig:
    """Read, merge includes, apply `key.sub=value` overrides, validate."""
    path = Path(path)
    raw, sources = read_with_includes(path, seen=())
    overridden: list[tuple[tuple, str]] = []  # each --set's location in the config, and the option as given
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise KvbenchError(f"--set '{item}' is not of the form key=value")
        try:
            parsed = yaml.safe_load(value)
        except yaml.YAMLError:
            raise KvbenchError(f"--set '{item}': the value is not valid YAML") from None
        assign(raw, key.split("."), parsed)
        overridden.append((tuple(int(part) if part.isdigit() else part for part in key.split(".")), item))
    try:
        config = SweepConfig.model_validate(raw)
    except pydantic.ValidationError as exc:
        # a misspelt key is also the missing key it meant: the misspelling is the one to name
        error = min(exc.errors(), key=lambda e: e["type"] != "extra_forbidden")
        loc = tuple(error["loc"])
        message = error["msg"].removeprefix("Value error, ")
        if error["type"] == "extra_forbidden":
            message = f"unknown key '{loc[-1]}'{did_you_mean(str(loc[-1]), _allowed_keys(loc[:-1]))}"
        elif error["type"] == "missing":
            message = f"missing key '{loc[-1]}'"
        raise KvbenchError(f"{where_given(sources, overridden, loc)}: {dotted(loc)}: {message}") from None
    except _Located as exc:
        raise KvbenchError(f"{where_given(sources, overridden, exc.loc)}: {dotted(exc.loc)}: {exc}") from None
    # warned of once a config is valid, so that a bad one still ends in its one error line alone
    for budget in sorted({b for b in config.all_budgets() if type(b) is int}):
        warn_if_ratio_like(budget)
    return config


def _allowed_keys(loc: tuple) -> list[str]:
    """The keys the mapping at `loc` may hold: its section's fields (and, at the top, `include`)."""
    section: type[BaseModel] | None = SweepConfig
    for part in loc:
        field = None if isinstance(part, int) or section is None else section.model_fields.get(part)
        if field is not None:
            section = _section(field.annotation)
        elif not isinstance(part, int):  # an index stays in its list's section
            return []
    if section is None:
        return []
    return [*section.model_fields, *(["include"] if section is SweepConfig else [])]


def _section(annotation: Any) -> type[BaseModel] | None:
    """The config section a field holds, inside its list or optional (`list[ModelConfig] | None`)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for inner in typing.get_args(annotation):
        found = _section(inner)
        if found is not None:
            return found
    return None


