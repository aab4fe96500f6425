"""A dense gated MLP's int4 decode at one row as one persistent CUDA kernel (a candidate, not in the step yet).

The first increment of the persistent, layer-fused decode step (docs/DESIGN-NOTES.md): the gate | up product, the
silu·mul and the down product of one row of bf16 x, which today are three launches (two int4 GEMVs with their
start and drain, and inductor's activation kernel), run as the tasks of one launch whose blocks stay resident and
wait on counters instead of kernel boundaries (ops/cuda/int4_mlp.cu has the scheme and why it cannot deadlock).
It returns what the down GEMV returns, fp32 split-K partials [chunks, 1, N], for the next residual add and norm to
sum. Its bar before it joins the step: a 27B MLP within ~50 µs on an H100, against ~60 µs for today's three
launches and the norm (`scripts/bench_int4_mlp.py`).
"""

import torch
import torch.nn.functional as F

from . import cuda_build
from .gemv import INT4, STEP, dequantized

CHOICE = "fastqwen.ops.int4_mlp"
MAX_CHUNKS = 16  # K chunks of down (its partials): the counts' scratch holds MAX_CHUNKS + 2
_counts: dict = {}  # device → int32 [MAX_CHUNKS + 2], zero between launches (the kernel leaves them so)


def weights(linear) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """An int4 QuantLinear's (codes, scale, zero), as the op and `reference` take them."""
    return linear.qweight, linear.scale, linear.zero


def problem(x: torch.Tensor, gate_up, down, chunks: int) -> str | None:
    """What keeps the kernel from taking these operands (an error message that names the fix), or None: x must be
    one bf16 row [1, K] (or [1, 1, K]), gate_up and down int4 QuantLinears of group 128 without bias or act-order
    permutation, codes tiled (rows a multiple of 16), gate_up the fused gate | up [2I, K] of down [N, I], and I
    split into `chunks` (≤ MAX_CHUNKS) whole groups. No exceptions: the model asks it inside a traced step."""
    from ..quant.linear import QuantLinear  # (quant imports ops)

    for name, lin in (("gate_up", gate_up), ("down", down)):
        if not (isinstance(lin, QuantLinear) and lin.scheme == "int4" and lin.group == STEP and lin.bias is None
                and getattr(lin, "perm", None) is None and lin.qweight.dim() == 4):
            return (f"int4_mlp: {name} must be an int4 QuantLinear of group {STEP}, bias-free, without act-order and "
                    f"with rows a multiple of 16 (quantize with quant='int4'); got {type(lin).__name__}")
    I, K = down.in_features, gate_up.in_features
    if gate_up.out_features != 2 * I:
        return (f"int4_mlp: gate_up must be the fused gate | up of {2 * I} rows for down's {I} inputs; got "
                f"{gate_up.out_features}")
    if x.dtype != torch.bfloat16 or x.numel() != K or x.shape[-1] != K:
        return f"int4_mlp takes one bf16 row of {K} (decode at batch 1); got {x.dtype} {tuple(x.shape)}"
    if not 1 <= chunks <= MAX_CHUNKS or I % (chunks * STEP):
        return (f"int4_mlp: chunks must be 1 … {MAX_CHUNKS} and split down's {I} inputs into whole groups of "
                f"{STEP}; got {chunks}")
    return None


def reference(x: torch.Tensor, gq, gs, gz, dq, ds, dz, chunks: int) -> torch.Tensor:
    """The kernel's output in plain torch: fp32 [chunks, 1, N] for x [1, K] and the int4 tensors of gate | up (gq,
    gs, gz) and down (dq, ds, dz) in QuantLinear's layout. gate and up are fp32 sums over all of K rounded to bf16,
    h = bf16(silu(gate) · up) in fp32, and chunk c is h's columns [c I / chunks, (c + 1) I / chunks) times down's,
    in fp32."""
    gu = x.float().reshape(1, -1) @ dequantized(INT4, gq, gs, gz).t()
    I = gu.shape[-1] // 2
    gate, up = gu[:, :I].to(torch.bfloat16).float(), gu[:, I:].to(torch.bfloat16).float()
    h = (F.silu(gate) * up).to(torch.bfloat16).float()
    W = dequantized(INT4, dq, ds, dz)
    width = I // chunks
    return torch.stack([h[:, k:k + width] @ W[:, k:k + width].t() for k in range(0, I, width)])


def reserve(device: torch.device) -> torch.Tensor:
    """The device's counts, allocated zeroed on first use: call it before a CUDA graph is captured."""
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device not in _counts:
        _counts[device] = torch.zeros(MAX_CHUNKS + 2, device=device, dtype=torch.int32)
    return _counts[device]


def blocks(device: torch.device, cap: int = 0) -> int:
    """How many blocks the kernel runs on this GPU: as many as are resident at once (at most `cap`, 0: none)."""
    fn = cuda_build.build("int4_mlp", cuda_build.device_arch(device, CHOICE), CHOICE).fastqwen_int4_mlp_blocks
    return fn(cap, device.index if device.index is not None else torch.cuda.current_device())


def int4_mlp(x: torch.Tensor, gate_up, down, chunks: int = 4, cap: int = 0, pdl: bool = False) -> torch.Tensor:
    """down(silu(gate) · up) of one row x as fp32 partials [chunks, 1, N] (their sum is the MLP's output), for the
    int4 QuantLinears gate_up (the fused gate | up) and down (`problem`): the persistent kernel on CUDA tensors (cap:
    at most that many blocks, for sweeps; pdl: programmatic dependent launch), `reference` elsewhere. One launch at a
    time a GPU (the counts are the device's)."""
    if (message := problem(x, gate_up, down, chunks)) is not None:
        raise ValueError(message)
    return int4_mlp_op(x.reshape(1, -1), *weights(gate_up), *weights(down), chunks, cap, pdl)


@torch.library.custom_op("fastqwen::int4_mlp", mutates_args=())
def int4_mlp_op(x: torch.Tensor, gq: torch.Tensor, gs: torch.Tensor, gz: torch.Tensor, dq: torch.Tensor,
                ds: torch.Tensor, dz: torch.Tensor, chunks: int, cap: int = 0, pdl: bool = False) -> torch.Tensor:
    """`int4_mlp` on checked operands: x [1, K] bf16, gate | up's and down's int4 tensors (QuantLinear's layout,
    codes tiled), as a registered op for compiled steps."""
    if not x.is_cuda:
        return reference(x, gq, gs, gz, dq, ds, dz, chunks)
    K, I, N = x.shape[-1], dq.shape[1] * STEP, ds.shape[0]
    x = cuda_build.aligned(x)
    counts = reserve(x.device)
    h = torch.empty(I, device=x.device, dtype=torch.bfloat16)
    out = torch.empty(chunks, 1, N, device=x.device, dtype=torch.float32)
    n = blocks(x.device, cap)
    fn = cuda_build.entry("int4_mlp", cuda_build.device_arch(x.device, CHOICE), CHOICE, pointers=10, ints=7)
    err = fn(x.data_ptr(), gq.data_ptr(), gs.data_ptr(), gz.data_ptr(), dq.data_ptr(), ds.data_ptr(), dz.data_ptr(),
             h.data_ptr(), out.data_ptr(), counts.data_ptr(), I, K, N, chunks, n, int(pdl), x.device.index,
             torch.cuda.current_stream(x.device).cuda_stream)
    if err:
        raise RuntimeError(f"int4_mlp launch failed: CUDA error {err} ({n} blocks, chunks {chunks})")
    return out


@int4_mlp_op.register_fake
def _(x, gq, gs, gz, dq, ds, dz, chunks, cap=0, pdl=False):
    return x.new_empty(chunks, 1, ds.shape[0], dtype=torch.float32)
