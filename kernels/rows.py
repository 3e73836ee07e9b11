"""How the kernels reach a row (one token's d values): the [heads, head size] register tile, and the pointer table.

Every kernel holds a row as a [heads, head size] tile, so the full-width RMS that couples the heads is a plain
reduction and per-head values broadcast without gathers. Routing sources reach the kernels through an int64 table
of one entry per source, so the history is never concatenated; its fields are named once, here.
"""

from collections.abc import Sequence

import torch
import triton
import triton.language as tl
from torch import Tensor

# The pointer table: int64 [S, FIELDS], one entry per source. These offsets name its fields, for the host code that
# builds an entry (in this order) and the kernels that read it.
ADDRESS = tl.constexpr(0)  # of the source's first row
OUTER_STRIDE = tl.constexpr(1)  # elements between rows along the outer leading dim
INNER_STRIDE = tl.constexpr(2)  # elements between rows along the inner leading dim (0 for a broadcast view)
DTYPE_TAG = tl.constexpr(3)  # DTYPE_TAGS of the source
GRAD_ADDRESS = tl.constexpr(4)  # of its gradient buffer (contiguous, the source's dtype); 0 when the call writes none
FIELDS = tl.constexpr(5)
FIELD_ALIGNMENT = (16, 8, 8, 1, 16)  # per field, for 16-byte vectors: addresses in bytes, strides in elements
# Load kinds, per launch, of source 0 and of the others: every such source fp32, every one bf16, or either.
FP32, BF16, EITHER = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)
DTYPE_TAGS = {torch.float32: FP32.value, torch.bfloat16: BF16.value}  # a source's tag is its load kind


@triton.jit
def row_tile(H, DH, BH: tl.constexpr, BDH: tl.constexpr):
    """Head index, its mask, the tile mask and the column offsets of a [heads, head size] row tile (padded to powers
    of two)."""
    h = tl.arange(0, BH)
    j = tl.arange(0, BDH)
    hmask = h < H
    return h, hmask, hmask[:, None] & (j < DH)[None, :], h[:, None] * DH + j[None, :]


@triton.jit
def query_tiles(u_ptr, D, cols, mask, Q: tl.constexpr):
    """The folded queries u0 and u1 ([Q, D] at u_ptr) as row tiles; u1 is u0 when Q = 1. Two queries are two tiles
    in the row's layout: a [queries, heads, head size] tile lays the query axis across warps and measured up to 8x
    slower per kernel on an H200."""
    u0 = tl.load(u_ptr + cols, mask=mask, other=0.0)
    u1 = u0
    if Q == 2:
        u1 = tl.load(u_ptr + D + cols, mask=mask, other=0.0)
    return u0, u1


@triton.jit
def _ptr(base, dtype: tl.constexpr, ALIGN: tl.constexpr):
    """Typed pointer from an address; ALIGN promises 16-byte alignment, so loads become 16-byte vectors."""
    p = base.to(tl.pointer_type(dtype))
    if ALIGN:
        p = tl.multiple_of(p, 16)
    return p


@triton.jit
def issue_row(table, n, ok, i0, i1, cols, mask, KIND: tl.constexpr, ALIGN: tl.constexpr):
    """Start loading row (i0, i1) of source n as stored (nothing where not `ok`); `row_value` turns the pair into
    fp32 where it is used, so the loads stay in flight until then. KIND: FP32, BF16 or EITHER (two masked loads,
    chosen by the source's tag)."""
    entry = table + FIELDS * n
    off = i0 * tl.load(entry + OUTER_STRIDE) + i1 * tl.load(entry + INNER_STRIDE)
    if ALIGN:
        off = tl.multiple_of(off, 8)
    base = tl.load(entry + ADDRESS)
    if KIND == FP32:
        x32 = tl.load(_ptr(base, tl.float32, ALIGN) + off + cols, mask=tl.where(ok, mask, False), other=0.0)
        x16 = x32
    elif KIND == BF16:
        x16 = tl.load(_ptr(base, tl.bfloat16, ALIGN) + off + cols, mask=tl.where(ok, mask, False), other=0.0)
        x32 = x16
    else:
        tag = tl.load(entry + DTYPE_TAG)
        m32, m16 = tl.where(ok & (tag == FP32), mask, False), tl.where(ok & (tag == BF16), mask, False)
        x32 = tl.load(_ptr(base, tl.float32, ALIGN) + off + cols, mask=m32, other=0.0)
        x16 = tl.load(_ptr(base, tl.bfloat16, ALIGN) + off + cols, mask=m16, other=0.0)
    return x32, x16


@triton.jit
def row_value(x32, x16, KIND: tl.constexpr):
    """The fp32 row from what `issue_row` loaded."""
    if KIND == FP32:
        x = x32
    elif KIND == BF16:
        x = x16.to(tl.float32)
    else:
        x = x32 + x16.to(tl.float32)
    return x


@triton.jit
def store_grad_row(table, n, row, D, cols, mask, x, ALIGN: tl.constexpr):
    """Store an fp32 row into the gradient buffer of source n (contiguous, the source's dtype).

    A branch rather than two masked stores: the fp32 store may need its own register layout, and
    the branch not taken costs nothing."""
    base = tl.load(table + FIELDS * n + GRAD_ADDRESS)
    off = row * D
    if tl.load(table + FIELDS * n + DTYPE_TAG) == FP32:
        tl.store(_ptr(base, tl.float32, ALIGN) + off + cols, x, mask=mask)
    else:
        tl.store(_ptr(base, tl.bfloat16, ALIGN) + off + cols, x.to(tl.bfloat16), mask=mask)


def _rows(v: Tensor, lead: torch.Size) -> tuple[Tensor, int, int]:
    """A [outer, inner, d] view of `v` (rows addressed by two strides, stride 0 allowed); copies only if
    no such view exists or the dtype is neither fp32 nor bf16."""
    if v.dim() == 3 and v.stride(-1) == 1 and v.dtype in DTYPE_TAGS:  # [B, T, d]: the common case, as is
        return v, v.stride(0), v.stride(1)
    if v.dtype not in DTYPE_TAGS:
        v = v.float()
    inner = lead[-1] if len(lead) else 1
    outer = v.numel() // max(v.shape[-1] * inner, 1)
    if v.stride(-1) != 1:
        v = v.contiguous()
    try:
        v2 = v.view(outer, inner, v.shape[-1])
    except RuntimeError:
        v2 = v.reshape(outer, inner, v.shape[-1])
    return v2, v2.stride(0), v2.stride(1)


def launch_stream(device: torch.device) -> int:
    """The CUDA stream Triton launches on, read as Triton's launcher reads it: 0.09 us a call on an H200's host, against
    1.6-5 us for the public `torch.cuda.current_stream(device).cuda_stream`, which builds a Stream object."""
    return triton.runtime.driver.active.get_current_stream(device.index)


_TABLES: dict[tuple, tuple[Tensor, bool, int, int]] = {}  # pointer tables by content: the allocator reuses addresses
_TABLES_MAX = 4096


def pointer_table(
    sources: Sequence[Tensor], lead: torch.Size, grads: Sequence[Tensor] = ()
) -> tuple[Tensor, list[Tensor], bool, int, int]:
    """The int64 [S, FIELDS] table of the sources (and of their gradient buffers, if given).

    Returns it with the views it points into (kept alive until launch), whether every address and
    row offset is 16-byte aligned, and the load kinds of source 0 and of the others (see `issue_row`).
    A table is a pure function of its content, so it is built once (in pinned memory, copied without a
    sync) and then reused from a cache keyed by that content and the stream. Cached tables may be freed,
    and a graph replay would re-read freed memory, so capture into a CUDA graph is refused.
    """
    device = sources[0].device
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            "fused depth routing cannot be captured in a CUDA graph (its pointer tables live on the host side); "
            "compile without mode='reduce-overhead' or use MHAR_ROUTE_BACKEND=reference"
        )
    views, entries = [], []
    for n, v in enumerate(sources):
        v2, outer, inner = _rows(v, lead)
        views.append(v2)
        grad = grads[n].data_ptr() if grads else 0
        entries += (v2.data_ptr(), outer, inner, DTYPE_TAGS[v2.dtype], grad)  # ADDRESS .. GRAD_ADDRESS
    stream = launch_stream(device) if device.type == "cuda" else 0
    key = (device, stream, views[0].shape[-1], *entries)
    if key not in _TABLES:
        if len(_TABLES) >= _TABLES_MAX:
            _TABLES.clear()
        fields = FIELDS.value
        aligned = key[2] % 8 == 0 and all(x % FIELD_ALIGNMENT[i % fields] == 0 for i, x in enumerate(entries))
        tags = entries[DTYPE_TAG.value :: fields]
        rest = set(tags[1:]) or {tags[0]}
        table = torch.tensor(entries, dtype=torch.int64, pin_memory=device.type == "cuda")
        kind_rest = rest.pop() if len(rest) == 1 else EITHER.value
        _TABLES[key] = table.to(device, non_blocking=True), aligned, tags[0], kind_rest
    table, aligned, k0, kr = _TABLES[key]
    return table, views, aligned, k0, kr
