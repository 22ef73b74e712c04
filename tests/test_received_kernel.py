"""The Triton kernels of a prompt's attention statistics on a GPU (kvbench/engine/received_kernel.py), run here on
CPU by Triton's interpreter, against the softmax's column sums written from the definition."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.test_attention_stats import assert_probs_close, reference

pytest.importorskip("triton", reason="Triton has no wheel for this platform: the GPU kernel is not tested here")
from kvbench.engine.received_kernel import attention_received_kernel  # noqa: E402  (interpreted: tests/conftest.py)

ROOT = Path(__file__).resolve().parent.parent


def column_sums(query, key, padding, scaling) -> torch.Tensor:
    """`[B, kv_heads, n]`: each slot's softmax weights summed over the queries, averaged over its query heads."""
    batch, kv_heads, n = key.shape[:3]
    probs = reference(query.float(), key.float(), padding, scaling)
    return probs.sum(dim=2).view(batch, kv_heads, -1, n).mean(dim=2)


def left_padded(batch: int, kv_heads: int, slots: int, queries: int) -> torch.Tensor:
    """Row b starts with 5 * b padding slots; the last row's reach into its queries, so some of them see nothing."""
    padding = torch.zeros(batch, kv_heads, slots, dtype=torch.bool)
    for row in range(batch):
        padding[row, :, : 5 * row + (row == batch - 1) * (slots - queries)] = True
    return padding


# (batch, heads, kv heads, queries, slots, head dim, block): prompts after a cached prefix (queries < slots, its
# offset no multiple of a block), several blocks each way, a ragged last block, a head dim below a power of two,
# grouped and ungrouped heads
SHAPES = [(2, 4, 2, 37, 53, 24, 16), (3, 6, 2, 10, 25, 8, 16), (1, 2, 2, 40, 40, 64, 32), (2, 8, 2, 33, 70, 16, 16)]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda shape: "x".join(map(str, shape)))
@pytest.mark.parametrize("padded", [False, True])
def test_kernel_gives_the_column_sums_of_the_softmax(shape, padded):
    batch, heads, kv_heads, queries, slots, dim, block = shape
    generator = torch.Generator().manual_seed(sum(shape))
    query = torch.randn(batch, queries, heads, dim, generator=generator).transpose(1, 2)  # as the model lays it out
    key = torch.randn(batch, kv_heads, slots, dim, generator=generator)
    padding = left_padded(batch, kv_heads, slots, queries) if padded else None
    scaling = dim**-0.5
    received = attention_received_kernel(query, key, scaling, padding, block=block)
    assert received.dtype == torch.float32 and received.shape == (batch, kv_heads, slots)
    assert_probs_close(received, column_sums(query, key, padding, scaling), query, key,
                       reduced=queries + heads // kv_heads, scaling=scaling)
    if padded:
        assert received[padding].eq(0).all()  # a padding slot receives nothing


def test_kernel_scores_half_precision_inputs_in_float32():
    # float16, as Triton's interpreter multiplies no bfloat16 (on a GPU `kvbench check` scores bfloat16 H2O): a 16-bit
    # product is exact in the float32 accumulator, so the logits are the float32 ones of the rounded inputs
    generator = torch.Generator().manual_seed(5)
    query = torch.randn(1, 4, 20, 32, generator=generator).half()
    key = torch.randn(1, 2, 30, 32, generator=generator).half()
    received = attention_received_kernel(query, key, 0.2, block=16)
    assert received.dtype == torch.float32
    assert_probs_close(received, column_sums(query, key, None, 0.2), query, key, reduced=20 + 2, scaling=0.2)



def tensor_core_kernels(dtype: str) -> dict[str, bool]:
    """Each kernel compiled ahead of time for an H100 (sm_90, by Triton's own ptxas) with `dtype` inputs: whether its
    PTX multiplies on the tensor cores (wgmma). Needs Triton's compiler, not its interpreter."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile

    from kvbench.engine import received_kernel

    found = {}
    for kernel in (received_kernel._row_logsumexp, received_kernel._column_sums):
        pointers = {"query": f"*{dtype}", "key": f"*{dtype}", "padding": "*u8", "lse": "*fp32", "received": "*fp32"}
        signature = {param.name: pointers.get(param.name, "fp32" if param.name == "scale_log2" else "i32")
                     for param in kernel.params if not param.is_constexpr}
        constants = dict(GROUP=4, DIM=128, HAS_PADDING=True, PRECISION="tf32" if dtype == "bf16" else "ieee",
                         BLOCK_M=received_kernel.BLOCK, BLOCK_N=received_kernel.BLOCK, BLOCK_D=128)
        ptx = compile(ASTSource(kernel, signature, constexprs=constants), target=GPUTarget("cuda", 90, 32)).asm["ptx"]
        found[kernel.fn.__name__] = "wgmma.mma_async" in ptx
    return found


def test_kernels_compile_for_a_gpu_with_16_bit_products_on_tensor_cores():
    # the interpreter runs code a GPU's compiler refuses: each kernel must build for one, a bfloat16 model's logits on
    # its tensor cores, a float32 model's IEEE (in a process of its own: this one's Triton interprets)
    environment = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    code = ("import json; from tests.test_received_kernel import tensor_core_kernels; "
            "print(json.dumps({dtype: tensor_core_kernels(dtype) for dtype in ('bf16', 'fp32')}))")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=environment, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.splitlines()[-1])
    assert found == {"bf16": {"_row_logsumexp": True, "_column_sums": True},
                     "fp32": {"_row_logsumexp": False, "_column_sums": False}}
