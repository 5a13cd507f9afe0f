"""Low-bit target weights: 32-weight blocks with a scale and an offset, as GGUF stores them, in
the layout the engine's own kernels read (engine/native.py, csrc/qmm.cpp).

Two formats, both llama.cpp's:
- `q4_1`: u in 0..15, w = d u + m (GGUF Q4_1; 0.625 bytes a weight with fp16 d and m);
- `q8_0`: q in -128..127, w = d q (GGUF Q8_0); held as u = q + 128 with m = -128 d, so one
  kernel reads both.
A GGUF's own blocks are taken as they are (`read_gguf`: no round trip through fp32), checked at
load against the weights the model holds; an fp32 weight is quantised as llama.cpp quantises
(`quantize`). The product (`QLinear`) quantises its input rows to int8 per 32 values, as
llama.cpp does, and gives each row the same bits whatever the number of rows."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

QK = 32  # weights per block
TILE = 16  # output columns per kernel tile
FORMATS = {"q4_1": 4, "q8_0": 8}


@dataclass(frozen=True)
class Blocks:
    """A weight (N, K) as blocks, in row order: u (N, K) uint8, d and m (N, K/32) fp16."""
    fmt: str
    u: np.ndarray
    d: np.ndarray
    m: np.ndarray

    @property
    def shape(self) -> tuple[int, int]:
        return self.u.shape

    def dequantize(self) -> torch.Tensor:
        """The fp32 weight these blocks stand for, computed as GGUF's reference does."""
        n, k = self.shape
        d = self.d.astype(np.float32)[:, :, None]
        u = self.u.reshape(n, k // QK, QK)
        if self.fmt == "q8_0":
            w = (u.astype(np.int16) - 128).astype(np.float32) * d
        else:
            w = d * u.astype(np.float32) + self.m.astype(np.float32)[:, :, None]
        return torch.from_numpy(np.ascontiguousarray(w.reshape(n, k)))

    def rows(self, order: np.ndarray) -> "Blocks":
        return Blocks(self.fmt, self.u[order], self.d[order], self.m[order])

    @staticmethod
    def stack(parts: list["Blocks"]) -> "Blocks":
        if len({p.fmt for p in parts}) != 1:
            raise ValueError("cannot stack weights of different formats")
        return Blocks(parts[0].fmt, *(np.concatenate([getattr(p, a) for p in parts]) for a in ("u", "d", "m")))


def quantize(weight: torch.Tensor, fmt: str) -> Blocks:
    """An fp32 weight (N, K) as blocks, rounded as llama.cpp's reference quantiser rounds."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown block format {fmt!r} (one of {', '.join(FORMATS)})")
    w = weight.detach().float().cpu().numpy()
    n, k = w.shape
    if k % QK:
        raise ValueError(f"a weight of {k} inputs cannot be cut into blocks of {QK}")
    g = w.reshape(n, k // QK, QK)
    if fmt == "q4_1":
        lo, hi = g.min(-1), g.max(-1)
        d = ((hi - lo) / 15).astype(np.float16)
        inv = np.divide(1.0, d.astype(np.float32), out=np.zeros_like(lo), where=d != 0)
        m = lo.astype(np.float16)
        u = np.clip(np.floor((g - m.astype(np.float32)[..., None]) * inv[..., None] + 0.5), 0, 15)
    else:
        d = (np.abs(g).max(-1) / 127).astype(np.float16)
        inv = np.divide(1.0, d.astype(np.float32), out=np.zeros_like(d, dtype=np.float32), where=d != 0)
        u = np.clip(np.rint(g * inv[..., None]), -128, 127) + 128
        m = (-128 * d.astype(np.float32)).astype(np.float16)
    return Blocks(fmt, u.astype(np.uint8).reshape(n, k), d, m)


# ---- GGUF ----------------------------------------------------------------------------------
GGUF_BLOCK = {"Q4_1": ("q4_1", 20), "Q8_0": ("q8_0", 34)}  # ggml type -> (format, bytes a block)


def gguf_blocks(tensor) -> Blocks:
    """A gguf.GGUFReader tensor of type Q4_1 or Q8_0 as Blocks (its rows as stored)."""
    kind = tensor.tensor_type.name
    if kind not in GGUF_BLOCK:
        raise ValueError(f"{tensor.name} is {kind}; the engine reads Q4_1 and Q8_0 blocks")
    fmt, size = GGUF_BLOCK[kind]
    k, n = (int(x) for x in tensor.shape)
    raw = np.asarray(tensor.data, dtype=np.uint8).reshape(n, k // QK, size)
    d = np.ascontiguousarray(raw[..., :2]).view(np.float16)[..., 0]
    if fmt == "q4_1":
        m = np.ascontiguousarray(raw[..., 2:4]).view(np.float16)[..., 0]
        qs = raw[..., 4:]  # (N, K/32, 16): value j in the low nibble, j + 16 in the high one
        u = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)
    else:
        u = (raw[..., 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
        m = (-128 * d.astype(np.float32)).astype(np.float16)
    return Blocks(fmt, np.ascontiguousarray(u.reshape(n, k)), d, m)


def unpermute_rows(n: int, heads: int) -> np.ndarray:
    """The row order that undoes llama.cpp's rotary permutation of a q or k weight (N rows,
    `heads` heads): GGUF row h*D + 2i + j holds HF's row h*D + j*D/2 + i."""
    dim = n // heads
    return np.arange(n).reshape(heads, dim // 2, 2).transpose(0, 2, 1).reshape(n)


# ---- the kernel's layout and product --------------------------------------------------------
class QLinear:
    """One weight in the kernel's layout: `x (..., K) fp32 -> (..., N) fp32`. The same kernel at
    every token count (`fn(n)` is itself), so rows never depend on how many come together."""

    buckets = (1,)
    names = ("qmm",)

    def __init__(self, blocks: Blocks, key: str | None = None):
        from dflash.engine import native

        if not native.available():
            raise RuntimeError(f"low-bit weights need the engine's native kernels: {native.problem()}")
        n, k = blocks.shape
        pad = -n % TILE
        if pad:  # whole tiles: extra zero rows, cut from the output
            blocks = Blocks(blocks.fmt, np.pad(blocks.u, ((0, pad), (0, 0))), np.pad(blocks.d, ((0, pad), (0, 0))),
                            np.pad(blocks.m, ((0, pad), (0, 0))))
        self.fmt, self.n, self.k, self.padded = blocks.fmt, n, k, n + pad
        self.bits = FORMATS[blocks.fmt]
        self.u, self.d, self.m = _tile(blocks)
        self.key = key or f"{n}x{k} {blocks.fmt}"
        self.extra_bytes = sum(t.numel() * t.element_size() for t in (self.u, self.d, self.m))
        self.weight = None
        self._op = torch.ops.dflash_lowbit.qmm

    def fn(self, n: int):
        return self

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = self._op(x, self.u, self.d, self.m, self.padded, self.bits)
        return y if self.padded == self.n else y[..., :self.n]


def _tile(blocks: Blocks) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """u (N, K) -> (tiles, blocks, 8 groups x 16 columns x 4 values) bytes, two groups to a byte
    for 4-bit values (group g low, g + 4 high); d, m -> (tiles, blocks, 16) fp16."""
    n, k = blocks.shape
    t, nb = n // TILE, k // QK
    u = blocks.u.reshape(t, TILE, nb, 8, 4).transpose(0, 2, 3, 1, 4)  # (tiles, blocks, group, column, value)
    if blocks.fmt == "q4_1":
        u = u[:, :, :4] | (u[:, :, 4:] << 4)
    scales = [torch.from_numpy(np.ascontiguousarray(a.reshape(t, TILE, nb).transpose(0, 2, 1))) for a in (blocks.d, blocks.m)]
    return (torch.from_numpy(np.ascontiguousarray(u).reshape(-1)), *scales)


def reference_product(x: torch.Tensor, blocks: Blocks) -> torch.Tensor:
    """What the kernel computes, in float64 from its own integer sums (for tests)."""
    q, d, s = torch.ops.dflash_lowbit.quantize(x.reshape(-1, x.shape[-1]))
    n, k = blocks.shape
    xq = q.double().reshape(-1, k // QK, QK)  # (M, B, 32)
    u = torch.from_numpy(blocks.u.astype(np.float64)).reshape(n, k // QK, QK)
    isum = torch.einsum("mbi,nbi->mnb", xq, u)  # (M, N, B)
    dw = torch.from_numpy(blocks.d.astype(np.float64))
    mw = torch.from_numpy(blocks.m.astype(np.float64))
    y = (isum * dw[None] * d.double()[:, None]).sum(-1) + (mw[None] * s.double()[:, None]).sum(-1)
    return y.reshape(*x.shape[:-1], n)
