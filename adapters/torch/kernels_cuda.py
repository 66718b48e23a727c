"""The int8 and int4 codecs' phases fused into Triton kernels for CUDA tensors (the kernel contract of
``hvdp.kernels``: encode with residual, decode-sum, decode), bit-identical to the array-op path.

One program handles ``ROWS`` whole blocks: it loads them once, keeps each block's absmax in
registers, and writes the int8 codes, the scales and (with error feedback) the new residual in
the same pass. Exactness against the numpy reference needs IEEE division and round-half-even
(``div_rn``, and rounding by the float32 addition itself), no fused multiply-add (the reference
rounds ``q * s`` before adding) and no flushing of subnormals: the launches pass
``enable_fp_fusion=False`` and ``enable_reflect_ftz=False``. ``TRITON_INTERPRET=1`` runs the
same kernels on the CPU (tests).

int4 (``hvdp/codecs/int4.py``): one program handles ``ROWS`` pairs of blocks, block b and block
b + n/(2B), whose codes share bytes (low and high nibble), so each byte is written once.
"""
import torch
import triton
import triton.language as tl

# -128 (a non-finite element's code) and 1e-38 (a flagged block's |scale| where its scale is 0) are the int8
# codec's constants (hvdp/codecs/int8.py), written as literals inside the kernels.
_EXACT = {"enable_fp_fusion": False, "enable_reflect_ftz": False}


@triton.jit
def _encode(x_ptr, prev_ptr, res_ptr, q_ptr, s_ptr, nblocks,
            BLOCK: tl.constexpr, ROWS: tl.constexpr, HAS_PREV: tl.constexpr, HAS_RES: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    offs = rows[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
    live = (rows < nblocks)[:, None]
    y = tl.load(x_ptr + offs, mask=live, other=0.0)
    if HAS_PREV:
        y = y + tl.load(prev_ptr + offs, mask=live, other=0.0)
    q, stored, r = _quant(y, 127.0, -128.0, HAS_RES)
    tl.store(q_ptr + offs, q.to(tl.int8), mask=live)
    tl.store(s_ptr + rows, stored, mask=rows < nblocks)
    if HAS_RES:
        tl.store(res_ptr + offs, r, mask=live)


@triton.jit
def _decode_sum(q_ptr, s_ptr, out_ptr, nblocks, nb, scale,
                P: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr, SCALE: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    offs = rows[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
    rlive = rows < nblocks
    live = rlive[:, None]
    n = nblocks * BLOCK
    q = tl.load(q_ptr + offs, mask=live, other=0).to(tl.float32)
    s = tl.abs(tl.load(s_ptr + n // 4 + rows, mask=rlive, other=0.0))
    acc = tl.where(q == -128.0, float("nan"), q * s[:, None])
    for j in range(1, P):  # P (the world size) is a compile-time constant: one build per job
        q = tl.load(q_ptr + j * nb + offs, mask=live, other=0).to(tl.float32)
        s = tl.abs(tl.load(s_ptr + (j * nb + n) // 4 + rows, mask=rlive, other=0.0))
        acc = acc + tl.where(q == -128.0, float("nan"), q * s[:, None])
    if SCALE:
        acc = acc * scale
    tl.store(out_ptr + offs, acc, mask=live)


@triton.jit
def _quant(y, QMAX: tl.constexpr, NF: tl.constexpr, HAS_RES: tl.constexpr):
    """One blockwise block per row of y, as ``hvdp.codecs.int8.quantise_blocks``: (codes in
    [-QMAX, QMAX], NF where not finite; the stored scales, negative for a flagged block; the
    residual y - decode, or y itself without HAS_RES)."""
    finite = tl.abs(y) < float("inf")  # False for +-inf and NaN
    scale = tl.math.div_rn(tl.max(tl.where(finite, tl.abs(y), 0.0), axis=1), QMAX)
    flagged = tl.max(tl.where(finite, 0, 1), axis=1) > 0
    safe = tl.where(scale > 0, scale, 1.0)
    # round half to even: |y / safe| <= QMAX for finite y, far below 2**22, where adding and
    # subtracting 1.5 * 2**23 rounds to an integer by the float32 addition's own rounding
    q = (tl.math.div_rn(y, safe[:, None]) + 12582912.0) - 12582912.0
    q = tl.minimum(tl.maximum(q, -QMAX), QMAX)
    q = tl.where(finite, q, NF)
    stored = tl.where(flagged, -tl.where(scale > 0, scale, 1e-38), scale).to(tl.float32)
    r = y
    if HAS_RES:
        dscale = tl.where(flagged & (scale <= 0), 1e-38, scale).to(tl.float32)  # what decode multiplies by
        r = y - q * dscale[:, None]
        r = tl.where(finite & (tl.abs(r) < float("inf")), r, 0.0)
    return q, stored, r


@triton.jit
def _encode4(x_ptr, prev_ptr, res_ptr, q_ptr, s_ptr, hb,
             BLOCK: tl.constexpr, ROWS: tl.constexpr, HAS_PREV: tl.constexpr, HAS_RES: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    offs = rows[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
    high = offs + hb * BLOCK  # the partner block in the chunk's second half
    rlive = rows < hb
    live = rlive[:, None]
    ya = tl.load(x_ptr + offs, mask=live, other=0.0)
    yc = tl.load(x_ptr + high, mask=live, other=0.0)
    if HAS_PREV:
        ya = ya + tl.load(prev_ptr + offs, mask=live, other=0.0)
        yc = yc + tl.load(prev_ptr + high, mask=live, other=0.0)
    qa, sa, ra = _quant(ya, 7.0, -8.0, HAS_RES)
    qc, sc, rc = _quant(yc, 7.0, -8.0, HAS_RES)
    byte = (qa + 8.0).to(tl.int32) | ((qc + 8.0).to(tl.int32) << 4)
    tl.store(q_ptr + offs, byte.to(tl.uint8), mask=live)
    tl.store(s_ptr + rows, sa, mask=rlive)
    tl.store(s_ptr + hb + rows, sc, mask=rlive)
    if HAS_RES:
        tl.store(res_ptr + offs, ra, mask=live)
        tl.store(res_ptr + high, rc, mask=live)


@triton.jit
def _decode_sum4(q_ptr, s_ptr, out_ptr, hb, nb, scale,
                 P: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr, SCALE: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    offs = rows[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
    rlive = rows < hb
    live = rlive[:, None]
    half = hb * BLOCK
    b = tl.load(q_ptr + offs, mask=live, other=0).to(tl.int32)
    qa, qc = ((b & 15) - 8).to(tl.float32), ((b >> 4) - 8).to(tl.float32)
    sa = tl.abs(tl.load(s_ptr + half // 4 + rows, mask=rlive, other=0.0))
    sc = tl.abs(tl.load(s_ptr + half // 4 + hb + rows, mask=rlive, other=0.0))
    acc_a = tl.where(qa == -8.0, float("nan"), qa * sa[:, None])
    acc_c = tl.where(qc == -8.0, float("nan"), qc * sc[:, None])
    for j in range(1, P):
        b = tl.load(q_ptr + j * nb + offs, mask=live, other=0).to(tl.int32)
        qa, qc = ((b & 15) - 8).to(tl.float32), ((b >> 4) - 8).to(tl.float32)
        sa = tl.abs(tl.load(s_ptr + (j * nb + half) // 4 + rows, mask=rlive, other=0.0))
        sc = tl.abs(tl.load(s_ptr + (j * nb + half) // 4 + hb + rows, mask=rlive, other=0.0))
        acc_a = acc_a + tl.where(qa == -8.0, float("nan"), qa * sa[:, None])
        acc_c = acc_c + tl.where(qc == -8.0, float("nan"), qc * sc[:, None])
    if SCALE:
        acc_a = acc_a * scale
        acc_c = acc_c * scale
    tl.store(out_ptr + offs, acc_a, mask=live)
    tl.store(out_ptr + half + offs, acc_c, mask=live)


class CudaInt8Kernels:
    """The int8 codec's fused phases on one CUDA device (see ``hvdp.kernels`` for the contract)."""

    path = "cuda-triton"

    def __init__(self, codec, elements_per_program=2048, warps=4):
        self.codec = codec
        self.block = codec.block_size
        # 2048 x 4 warps: the fastest of 2048..16384 x 4/8 on an H200 (benchmarks/cuda_codecs.py)
        self.rows = max(1, elements_per_program // self.block)  # whole blocks per program
        self.warps = warps

    def _grid(self, c):
        return (triton.cdiv(c // self.block, self.rows),)

    def encode(self, x, prev=None, residual=None, out=None):
        c = x.numel()
        if out is None:
            out = torch.empty(self.codec.payload_nbytes(c), dtype=torch.uint8, device=x.device)
        q, s = out[:c].view(torch.int8), _as_f32(out[c:])
        _encode[self._grid(c)](x, prev if prev is not None else x, residual if residual is not None else x,
                               q, s, c // self.block, BLOCK=self.block, ROWS=self.rows,
                               HAS_PREV=prev is not None, HAS_RES=residual is not None,
                               num_warps=self.warps, **_EXACT)
        if s.data_ptr() != out[c:].data_ptr():  # out's scale region was not 4-byte aligned
            out[c:].copy_(s.view(torch.uint8))
        return out

    def decode_sum(self, payloads, p, c, scale=1.0, out=None):
        nb = self.codec.payload_nbytes(c)
        payloads = payloads if payloads.data_ptr() % 4 == 0 else payloads.clone()
        if out is None:
            out = torch.empty(c, dtype=torch.float32, device=payloads.device)
        _decode_sum[self._grid(c)](payloads.view(torch.int8), payloads[:p * nb].view(torch.float32), out,
                                   c // self.block, nb, float(scale), P=p, BLOCK=self.block, ROWS=self.rows,
                                   SCALE=scale != 1.0, num_warps=self.warps, **_EXACT)
        return out

    def decode(self, payload, c, out=None):
        return self.decode_sum(payload, 1, c, 1.0, out=out)


def _as_f32(b):
    """A float32 view of uint8 bytes, or a fresh float32 buffer when they are not aligned."""
    if b.data_ptr() % 4 == 0:
        return b.view(torch.float32)
    return torch.empty(b.numel() // 4, dtype=torch.float32, device=b.device)


class CudaInt4Kernels:
    """The int4 codec's fused phases on one CUDA device (see ``hvdp.kernels`` for the contract)."""

    path = "cuda-triton"

    def __init__(self, codec, elements_per_program=2048, warps=4):
        self.codec = codec
        self.block = codec.block_size
        # a program holds ROWS pairs of blocks: 2 x ROWS x BLOCK values
        self.rows = max(1, elements_per_program // (2 * self.block))
        self.warps = warps

    def _grid(self, c):
        return (triton.cdiv(c // (2 * self.block), self.rows),)

    def encode(self, x, prev=None, residual=None, out=None):
        c = x.numel()
        half = c // 2
        if out is None:
            out = torch.empty(self.codec.payload_nbytes(c), dtype=torch.uint8, device=x.device)
        s = _as_f32(out[half:])
        _encode4[self._grid(c)](x, prev if prev is not None else x, residual if residual is not None else x,
                                out, s, c // (2 * self.block), BLOCK=self.block, ROWS=self.rows,
                                HAS_PREV=prev is not None, HAS_RES=residual is not None,
                                num_warps=self.warps, **_EXACT)
        if s.data_ptr() != out[half:].data_ptr():  # out's scale region was not 4-byte aligned
            out[half:].copy_(s.view(torch.uint8))
        return out

    def decode_sum(self, payloads, p, c, scale=1.0, out=None):
        nb = self.codec.payload_nbytes(c)
        payloads = payloads if payloads.data_ptr() % 4 == 0 else payloads.clone()
        if out is None:
            out = torch.empty(c, dtype=torch.float32, device=payloads.device)
        _decode_sum4[self._grid(c)](payloads, payloads[:p * nb].view(torch.float32), out,
                                    c // (2 * self.block), nb, float(scale), P=p, BLOCK=self.block,
                                    ROWS=self.rows, SCALE=scale != 1.0, num_warps=self.warps, **_EXACT)
        return out

    def decode(self, payload, c, out=None):
        return self.decode_sum(payload, 1, c, 1.0, out=out)


KERNELS = {"int8": CudaInt8Kernels, "int4": CudaInt4Kernels}
