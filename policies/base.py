"""The policy contract: a small dataclass that scores the live entries of one layer.

A policy never touches storage. The cache calls `observe()` after each attention (only when the
policy `needs_attention`) and, when it must evict, `score()`: the entries with the highest scores
are kept, `budget` of them per KV head. Entries a policy must never evict get `+inf`.

A policy whose scores can be read on a scale that means the same for every prompt says so in `threshold_scale`
and returns them from `threshold_score`: it then takes a threshold budget (`{threshold: 0.01}`, policies/budgets.py),
which keeps every entry that reaches it, any count per head.

A compression policy (quant, mixed_precision, lowrank) returns a storage `layout()` instead; any eviction
policy takes one with `storage:` (`{name: h2o, storage: {quant: {bits: 4}}}`): fewer tokens, fewer bits.

A sparse policy (quest) evicts nothing: the cache keeps every entry, and at each decode step `read_mask()` says
which of them the step's query attends to, `budget` tokens' worth (the engine masks the rest in
kvbench/engine/attention.py and counts the bytes read).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar, Literal, NamedTuple

import torch

from kvbench.errors import KvbenchError
from kvbench.policies.deprecated import translate_deprecated
from kvbench.policies.schedule import Demand, Schedule
from kvbench.registry import Registry, declared_params

if TYPE_CHECKING:
    from kvbench.engine.cache import KVCache
    from kvbench.engine.layer import LayerKV
    from kvbench.engine.models import LoadedModel
    from kvbench.engine.session import Session
    from kvbench.engine.storage import Layout
    from kvbench.policies.reference import Reference

HookScope = Literal["active", "first", "all"]


class BatchLimit(NamedTuple):
    """What keeps a policy's rows of a batch from evicting as each would alone: `rows` "equal" (it batches
    only rows of one prompt length, which need no padding) or "alone" (it runs one sequence at a time), and why,
    in one line."""

    rows: Literal["equal", "alone"]
    reason: str


def hook(scope: HookScope) -> Callable[[Callable], Callable]:
    """Marks a `Policy` method as a hook, which a `Wrapper` forwards to its stages by `scope`: to the stage in
    charge of the call's cache ("active"), to the stage that compresses the prompt ("first"), or to every
    stage, their results combined ("all")."""
    def mark(method: Callable) -> Callable:
        method.hook_scope = scope
        return method
    return mark


def hooks() -> dict[str, HookScope]:
    """Every hook of `Policy`, by name: what a wrapper forwards."""
    return {name: member.hook_scope for name, member in vars(Policy).items() if hasattr(member, "hook_scope")}


# methods of a policy's kind, not hooks every policy has, and the kind that has each; None: kvbench's own
NOT_ASKED: dict[str, str | None] = {"fold": "Merging", "layer_budgets": "LayerSpread", "read_mask": "Sparse",
                                    "observers": None, "state_keys": None}


@dataclasses.dataclass
class Policy:
    name: ClassVar[str]
    # when it compresses and how often; an instance whose parameters decide (`decode: true`, R-KV's buffer, a
    # wrapper's stages) sets its own in `__post_init__`
    schedule: ClassVar[Schedule] = Schedule.DECODE
    needs_attention: ClassVar[bool] = False
    # how it saves memory: drops entries (eviction), keeps every token in fewer bytes or entries (compression);
    # or how it saves reads: keeps every entry, each decode step reads a budget's worth of them (sparse)
    family: ClassVar[str] = "eviction"
    # what `threshold_score` measures, in words (the docs' table); None: the policy takes no threshold budget
    threshold_scale: ClassVar[str | None] = None
    # its colour in every figure (kvbench/analysis/plot.py), read from the class that declares it (a subclass is another
    # policy); None: one picked from the palette by its name
    colour: ClassVar[str | None] = None
    # the kept entries stored compressed: a storage policy's name, or {name: {params}}
    storage: str | dict[str, Any] | None = dataclasses.field(default=None, kw_only=True)

    # why this policy's decode steps cannot run on static buffers yet (kvbench/engine/step.py), in a few words;
    # None: they can
    eager_only: ClassVar[str | None] = None
    # set on a plugin class that still validates in `check_budget` or `check_settings`
    _legacy_checks: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        translate_deprecated(cls)
        for name in NOT_ASKED.keys() & vars(cls).keys():
            kind = NOT_ASKED[name]
            if kind is None or kind not in {base.__name__ for base in cls.__mro__}:
                raise KvbenchError(f"policy class {cls.__name__} defines `{name}`, which kvbench asks only of "
                                   + (f"a {kind} (kvbench.policies.base.{kind}): subclass it" if kind else
                                      "itself: it gathers a policy's statistics from `needs_attention`, a wrapper's "
                                      "stages and the storage"))

    @property
    def phases(self) -> tuple[str, ...]:
        """Deprecated (next release: gone): `schedule` says when the policy compresses."""
        return {"prefill": ("prefill",), "decode": ("prefill", "decode")}.get(self.schedule.when, ())

    @property
    def evicts_during_decode(self) -> bool:
        """Deprecated (next release: gone): `schedule.decodes`."""
        return self.schedule.decodes

    def __post_init__(self) -> None:
        if self.storage is not None and type(self).layout is not Policy.layout:
            raise KvbenchError(f"policy '{self.name}' is a storage itself; it takes no storage")
        if self.storage is not None and not self.schedule.evicts:
            raise KvbenchError(f"policy '{self.name}' keeps every entry as is; to compress them all, run the "
                               f"storage policy itself")
        self._storage = None if self.storage is None else storage_policy(self.storage, self.name)

    def layout(self) -> Layout | None:
        """How the cache stores the entries: None for plain slots in the model dtype."""
        return None if self._storage is None else self._storage.layout()

    def reference(self, lm: LoadedModel, prompt: list[int], decode: list[int], budget: int) -> Reference:
        """What a plain loop written from the paper keeps (policies/reference.py) after `prompt` and each `decode`
        token under `budget`; a policy whose class itself defines it is one `kvbench check` holds to it."""
        raise NotImplementedError(f"policy '{self.name}' has no plain-loop reference")

    @property
    def ring(self) -> int | None:
        """For a policy that evicts the oldest entry beyond its first ones (a window, StreamingLLM's sinks): how many
        first ones it keeps, so that its decode step writes around a ring (kvbench/engine/step.py); None: it scores."""
        return None

    def static_blocker(self) -> str | None:
        """Why this policy's decode steps run on the dynamic layout rather than on static buffers
        (kvbench/engine/step.py), in a few words; None: they step on static buffers."""
        if self.schedule.decodes and type(self).select is not Policy.select:
            return "it picks a kept set of any size per head while decoding"
        return self.eager_only

    @property
    def kind(self) -> str:
        """This instance's family: an eviction policy given a storage is a hybrid."""
        return "hybrid" if self.storage is not None else self.family

    @hook("all")
    def observe(
        self, layer: LayerKV, query: torch.Tensor, key: torch.Tensor, scaling: float, phase: str
    ) -> None:
        """Gather statistics after a layer's attention. `key` is every live key, the new ones last."""

    @hook("active")
    def score(self, layer: LayerKV, budget: int) -> torch.Tensor:
        """`[batch, kv_heads, length]` scores of the live slots; the top `budget` per head are kept."""
        raise NotImplementedError

    @hook("active")
    def threshold_score(self, layer: LayerKV) -> torch.Tensor:
        """`[batch, kv_heads, length]` scores on the `threshold_scale` scale (protected entries `+inf`): a threshold
        budget keeps those that reach it. By default `score()` with no budget to fit, for a policy whose scores
        already are on such a scale; a policy whose scores are not normalises them here."""
        return self.score(layer, layer.length)

    @hook("active")
    def select(self, layer: LayerKV, budget: int) -> torch.Tensor | None:
        """A `[batch, kv_heads, length]` keep mask with any count per head (Ada-KV); None: the top `budget`
        of `score()` per head."""
        return None

    @hook("all")
    def prepare(self, lm: LoadedModel) -> None:
        """Called when a session is made, before anything is fed: a policy may read or run the model here, once,
        untimed (RazorAttention's calibration forward, DuoAttention's pattern checked against the model's heads)."""

    @hook("first")
    def after_prompt(self, session: Session, prompt: torch.Tensor) -> None:
        """Called once the prompt `[rows, n]` is in `session`'s cache, before it is compressed: a policy may run
        extra forwards through it here (KVzip's reconstruction, with `session.probe`)."""

    @hook("active")
    def bounded(self, layer: LayerKV) -> bool:
        """Whether `layer` holds to its budget now; False: the policy leaves it whole (SimLayerKV's layers that are
        not lazy, every layer until adaptive's memory limit), so it is neither evicted nor sized to the budget, and
        grows as a full cache does."""
        return True

    @hook("all")
    def report(self) -> dict[str, Any]:
        """Events a record should carry (e.g. when an adaptive policy switched)."""
        return {}

    @hook("all")
    def batch_limits(self) -> list[BatchLimit]:
        """What keeps this policy from running rows of any lengths in one left-padded batch ([] for nothing):
        state that spans the rows, or scores that follow where a row's entries lie in the slots."""
        return []

    def check(self, demand: Demand) -> None:
        """Raise KvbenchError when this policy cannot run as `demand` asks. A policy with limits of its own (a budget
        beyond its window, no chunked prefill) extends it, calling `super().check(demand)` first."""
        if demand.threshold and self.threshold_scale is None:
            takers = ", ".join(name for name in POLICIES.names() if POLICIES.get(name).threshold_scale)
            raise KvbenchError(f"policy '{self.name}' takes no threshold budget: its scores have no normalised "
                               f"scale (policies that do: {takers})")
        if demand.budget is not None and demand.budget < 1:
            raise KvbenchError(f"{self.name}: budget must be at least 1 token, got {demand.budget}")

    def check_budget(self, budget: int) -> None:
        """Deprecated (next release: gone): `check(Demand(budget=budget))`."""
        # a plugin's own `check_budget` calls this through `super()` from inside its `check`: the base's part only
        (Policy.check if self._legacy_checks else type(self).check)(self, Demand(budget=budget))

    def check_settings(self, chunked: bool) -> None:
        """Deprecated (next release: gone): `check(Demand(chunked=chunked))`."""
        if not self._legacy_checks:
            self.check(Demand(chunked=chunked))

    def check_threshold(self) -> None:
        """Deprecated (next release: gone): `check(Demand(threshold=True))`."""
        self.check(Demand(threshold=True))

    @classmethod
    def params(cls) -> dict[str, Any]:
        """Parameter name -> default."""
        return declared_params(cls)

    def describe(self) -> dict[str, Any]:
        # an unset storage is left out, so descriptions (and statistic names) predating it are unchanged
        return {"name": self.name, **{key: getattr(self, key) for key in self.params()
                                      if key != "storage" or self.storage is not None}}

    @functools.cached_property
    def state_key(self) -> str:
        """Names this instance's per-slot statistics, so several policies can observe one shared prefill (worked
        out once: a compiled step reads it as a constant)."""
        return repr(sorted(self.describe().items()))


def takes_budget(policy: Policy | type[Policy]) -> bool:
    """Whether a budget means anything to `policy` (an instance or a class): it evicts to one, or reads one's worth
    per decode step (sparse). `full` and a storage policy alone keep every token whatever the budget."""
    return policy.schedule.when != "none"


POLICIES: Registry[Policy] = Registry("policy")
register = POLICIES.register
build_policy = POLICIES.build


def build_spec(spec: str | dict[str, Any]) -> Policy:
    """A policy from a name or a `{name: ..., param: value}` mapping (as wrappers take their stages)."""
    if isinstance(spec, str):
        return POLICIES.build(spec)
    spec = dict(spec)
    if "name" not in spec:
        raise KvbenchError(f"a policy mapping needs a 'name': {spec}")
    return POLICIES.build(spec.pop("name"), spec)


def storage_policy(spec: str | dict[str, Any], owner: str) -> Policy:
    """The compression policy a `storage:` option names: `quant` or `{quant: {bits: 4}}`."""
    if isinstance(spec, dict) and len(spec) == 1:
        (name, params), = spec.items()
    elif isinstance(spec, str):
        name, params = spec, {}
    else:
        raise KvbenchError(f"policy '{owner}': storage must be a name or {{name: {{params}}}}, got {spec!r}")
    policy = POLICIES.build(name, params or {})
    if type(policy).layout is Policy.layout:
        storages = ", ".join(n for n in POLICIES.names() if POLICIES.get(n).layout is not Policy.layout)
        raise KvbenchError(f"policy '{owner}': storage '{name}' is not a storage policy (use {storages})")
    return policy


@dataclasses.dataclass
class Wrapper(Policy):
    """A policy made of other policies, its stages (`_stages`, set in `__post_init__`). Every hook of `Policy`
    is forwarded to the stages by its scope (see `hook`; the forwarding methods are generated below), so a hook
    added to `Policy` reaches every wrapper. A wrapper overrides only what it decides itself, and names in
    `decides` the hooks it answers without asking its stages."""

    decides: ClassVar[frozenset[str]] = frozenset()
    _stages: tuple[Policy, ...] = dataclasses.field(default=(), init=False, repr=False, compare=False)

    @property
    def stages(self) -> tuple[Policy, ...]:
        return self._stages

    def stage(self, cache: KVCache) -> Policy:
        """The stage in charge of `cache` now (by default the first)."""
        return self._stages[0]

    def static_blocker(self) -> str | None:
        if self.schedule.decodes and "select" in self.decides:
            return "it picks a kept set of any size per head while decoding"
        return self.eager_only or next(filter(None, (stage.static_blocker() for stage in self._stages)), None)

    def check(self, demand: Demand) -> None:
        super().check(demand)
        for stage in self._stages:
            stage.check(demand)

    def build_stage(self, spec: str | dict[str, Any]) -> Policy:
        stage = build_spec(spec)
        if stage.storage is not None:
            raise KvbenchError(f"policy '{self.name}': give storage to '{self.name}' itself, not to its stage "
                               f"'{stage.name}'")
        return stage


@dataclasses.dataclass
class Rescorer(Wrapper):
    """A wrapper that ranks entries by its base policy's scores, rescored (chunkkv, criticalkv). The base must
    score entries for eviction and leave the kept set to its scores (not ada_kv or kvzip, which pick their own);
    its schedule is the wrapper's."""

    schedule: ClassVar[Schedule] = Schedule.PREFILL
    needs_attention: ClassVar[bool] = True
    base: str | dict[str, Any] = "snapkv"  # whose scores are rescored: a name, or {name: ..., params...}
    decides: ClassVar[frozenset[str]] = frozenset({"score"})

    def __post_init__(self) -> None:
        super().__post_init__()
        base = self.build_stage(self.base)
        if not base.schedule.evicts or type(base).score is Policy.score or type(base).select is not Policy.select:
            raise KvbenchError(f"policy '{self.name}': base '{base.name}' must score entries for eviction "
                               "(snapkv, knorm, h2o, expected_attention, ...)")
        self._stages = (base,)
        self.schedule = base.schedule  # type: ignore[misc]


@dataclasses.dataclass
class PromptScorer(Policy):
    """A prefill-time scorer that needs no attention to score (knorm, keydiff): it compresses the prompt, and with
    `decode: true` keeps evicting while decoding, so the budget holds for the whole generation."""

    schedule: ClassVar[Schedule] = Schedule.PREFILL
    decode: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.decode:
            self.schedule = Schedule.DECODE  # type: ignore[misc]


@dataclasses.dataclass
class RetrievalHeads(Policy):
    """A head-level policy (RazorAttention, DuoAttention): its retrieval heads keep every entry; every other KV head
    (a streaming head) keeps the first `sinks` entries and the most recent, `budget` in all, as StreamingLLM keeps
    them, while the prompt is compressed and while decoding. A subclass says which KV heads are retrieval heads
    (`retrieval_heads`); the kept counts differ per head, stored as Ada-KV's are (padded to a layer's widest head)."""

    sinks: int = 4

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.sinks < 0:
            raise KvbenchError(f"policy '{self.name}' parameter 'sinks' must be >= 0, got {self.sinks}")

    def check(self, demand: Demand) -> None:
        super().check(demand)
        if demand.budget is not None and demand.budget <= self.sinks:
            raise KvbenchError(f"{self.name}: budget {demand.budget} leaves its streaming heads no room beyond "
                               f"sinks={self.sinks}")

    def retrieval_heads(self) -> torch.Tensor:
        """`[layers, kv_heads]` booleans: True for the KV heads that keep every entry."""
        raise NotImplementedError

    def select(self, layer: LayerKV, budget: int) -> torch.Tensor:
        retrieval = self.retrieval_heads()[layer.layer_idx].to(layer.device)
        positions = layer.live_positions()
        # a padding slot holds an entry dropped before (neither a sink nor recent) or a batch's left padding, which
        # the cache drops whatever a policy selects
        return retrieval[None, :, None] | (positions < self.sinks) | recent_mask(layer, budget - self.sinks)


@dataclasses.dataclass
class Merging(Policy):
    """A policy that merges what it evicts (merge): before the slots `evicted` `[batch, heads, e]` leave, `fold`
    writes them into entries that stay. Its decode steps run on the dynamic layout (they write into kept slots)."""

    def fold(self, layer: LayerKV, evicted: torch.Tensor) -> None:
        raise NotImplementedError


@dataclasses.dataclass
class LayerSpread(Policy):
    """A policy that spreads its budget unevenly over the layers (PyramidKV): `layer_budgets` is each layer's entries
    per KV head; `prompt_tokens`, when the cache knows it, lets it cap a layer at what the prompt holds."""

    def layer_budgets(self, budget: int, num_layers: int, prompt_tokens: int | None = None) -> list[int]:
        raise NotImplementedError


@dataclasses.dataclass
class Sparse(Policy):
    """A policy that keeps every entry and chooses what each decode step reads (Quest): `read_mask` is
    `[batch, heads or kv_heads, length]`, True on the slots the one-token `query` `[batch, heads, 1, head_dim]`
    attends to (the new token's slot among them), about `budget` per head; None: every slot."""

    schedule: ClassVar[Schedule] = Schedule.READ
    family: ClassVar[str] = "sparse"

    def read_mask(self, layer: LayerKV, query: torch.Tensor, budget: int) -> torch.Tensor | None:
        raise NotImplementedError


def acting(policy: Policy, cache: KVCache | None = None) -> Policy:
    """The policy that acts for `policy`: down through wrappers, the stage in charge of `cache` (the first stage, the
    one that compresses the prompt, without a cache)."""
    while isinstance(policy, Wrapper):
        policy = policy._stages[0] if cache is None else policy.stage(cache)
    return policy


def spread_budgets(policy: Policy, budget: int, num_layers: int, prompt_tokens: int | None = None) -> list[int]:
    """Entries per KV head for each layer: `budget` everywhere, unless the policy spreads it (`LayerSpread`)."""
    first = acting(policy)
    return first.layer_budgets(budget, num_layers, prompt_tokens) if isinstance(first, LayerSpread) \
        else [budget] * num_layers


def folds(policy: Policy) -> bool:
    """Whether `policy` or a stage of it merges what it evicts (`Merging`)."""
    return isinstance(policy, Merging) or isinstance(policy, Wrapper) and any(map(folds, policy.stages))


def fold_evicted(policy: Policy, layer: LayerKV, evicted: torch.Tensor) -> None:
    """Before `evicted` leave `layer`: the acting policy folds them into kept entries if it merges."""
    active = acting(policy, layer.owner)
    if isinstance(active, Merging):
        active.fold(layer, evicted)


def sparse_reads(policy: Policy, layer: LayerKV, query: torch.Tensor, budget: int) -> torch.Tensor | None:
    """What a decode step reads of `layer`: the acting policy's choice if it is sparse (`Sparse`), else None (all)."""
    active = acting(policy, layer.owner)
    return active.read_mask(layer, query, budget) if isinstance(active, Sparse) else None


def observers_of(policy: Policy) -> list[Policy]:
    """The policies whose `observe` must run for `policy`: each of its leaves that needs attention."""
    return _of_leaves(policy, lambda leaf: [leaf] if leaf.needs_attention else [])


def state_keys_of(policy: Policy) -> list[str]:
    """Every per-slot statistic `policy` reads: each of its leaves' own."""
    return _of_leaves(policy, lambda leaf: [leaf.state_key])


def _of_leaves(policy: Policy, answer: Callable[[Policy], list]) -> list:
    """`answer` of every policy `policy` is made of, in order: itself (a wrapper: its stages, and theirs), then its
    storage (ThinK observes the prompt's queries)."""
    own = [item for stage in policy.stages for item in _of_leaves(stage, answer)] if isinstance(policy, Wrapper) \
        else answer(policy)
    return own + ([] if policy._storage is None else _of_leaves(policy._storage, answer))


def _forwarding(name: str, scope: HookScope) -> Callable:
    def forward(self: Wrapper, *args: Any, **kwargs: Any) -> Any:
        if scope == "all":  # the wrapper's own storage is asked too (ThinK observes the prompt's queries)
            stages = self._stages if self._storage is None else (*self._stages, self._storage)
            return _combined([getattr(stage, name)(*args, **kwargs) for stage in stages])
        # an "active" hook's first argument is a layer (whose owner is the cache) or the cache
        stage = self._stages[0] if scope == "first" else self.stage(getattr(args[0], "owner", args[0]))
        return getattr(stage, name)(*args, **kwargs)

    forward.__name__ = forward.__qualname__ = name
    forward.__doc__ = f"`Policy.{name}` of the stages (scope: {scope})."
    forward.hook_scope = scope
    forward.forwards = True
    return forward


def _combined(results: list[Any]) -> Any:
    """Every stage's answer to an "all" hook as one: nothing, merged mappings or concatenated lists."""
    if all(result is None for result in results):
        return None
    if all(isinstance(result, dict) for result in results):
        return {key: value for result in results for key, value in result.items()}
    if all(isinstance(result, list) for result in results):
        return [item for result in results for item in result]
    raise TypeError(f"cannot combine the stages' answers {results!r}")


for _name, _scope in hooks().items():
    setattr(Wrapper, _name, _forwarding(_name, _scope))


def batch_limit(policy: Policy) -> BatchLimit | None:
    """The strictest of `policy`'s batch limits (its stages' included), or None: it batches any rows."""
    limits = policy.batch_limits()
    if policy.layout() is not None and policy.schedule.evicts:  # which entries each row keeps in which tier: its own
        limits.append(BatchLimit("alone", f"policy '{policy.name}' evicts from compressed storage, whose tiers are "
                                          "kept for one sequence"))
    elif policy.layout() is not None:  # every row holds every token alike: the batch's bytes are the rows' sum
        limits.append(BatchLimit("equal", f"policy '{policy.name}' stores entries in tiers by position, which a "
                                          "batch's rows share only at one length"))
    return min(limits, key=lambda limit: limit.rows != "alone", default=None)


def recent_mask(layer: LayerKV, count: int) -> torch.Tensor:
    """True for the live entries among the `count` most recent tokens."""
    return layer.live_positions() >= layer.next_position() - count


def protect(scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return scores.masked_fill(mask, float("inf"))


def shares(weights: torch.Tensor, layer: LayerKV) -> torch.Tensor:
    """Each entry's share of its head's total `weights` (non-negative), as an attention weight is: a threshold on
    it means the same whatever the weights' scale. Protected (+inf) entries stay +inf and count for nothing, as
    padding slots do."""
    held = torch.isfinite(weights)
    if layer.padding() is not None:
        held &= ~layer.padding()
    total = torch.where(held, weights, 0.0).sum(dim=-1, keepdim=True)
    return torch.where(held, weights / total.clamp(min=torch.finfo(weights.dtype).tiny), weights)


def positive(name: str, **values: float) -> None:
    for key, value in values.items():
        if value <= 0:
            raise KvbenchError(f"policy '{name}' parameter '{key}' must be positive, got {value}")
