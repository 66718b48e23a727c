"""hvdp's array-ops protocol (``hvdp.ops.ArrayOps``) filled with torch ops."""
import torch

_DT = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
       "float64": torch.float64, "int8": torch.int8, "uint8": torch.uint8, "int32": torch.int32,
       "int64": torch.int64}


class TorchOps:
    name = "torch"
    writable_views = True  # .numpy() of a CPU tensor shares its memory

    def zeros(self, n, dtype="float32", like=None):
        return torch.zeros(n, dtype=_DT[dtype], device=like.device if like is not None else None)

    def empty(self, n, dtype="float32", like=None):
        return torch.empty(n, dtype=_DT[dtype], device=like.device if like is not None else None)

    def size(self, x):
        return x.numel()

    def reshape(self, x, shape):
        return x.reshape(shape)

    def cat(self, xs):
        return torch.cat([x.reshape(-1) for x in xs]) if len(xs) else torch.zeros(0)

    def cast(self, x, dtype):
        return x.to(_DT[dtype])

    def dtype(self, x):
        return str(x.dtype).replace("torch.", "")

    def to_bytes(self, x):
        return x.contiguous().reshape(-1).view(torch.uint8)

    def from_bytes(self, b, dtype):
        b = b.contiguous()
        try:
            return b.view(_DT[dtype])
        except RuntimeError:  # a slice not aligned to the wider dtype: copy it first
            return b.clone().view(_DT[dtype])

    def abs(self, x):
        return x.abs()

    def amax_rows(self, x2d):
        return x2d.amax(dim=-1)

    def round(self, x):
        return torch.round(x)

    def clip(self, x, lo, hi):
        return torch.clamp(x, lo, hi)

    def where(self, cond, a, b):
        return torch.where(cond, a, b)

    def isfinite(self, x):
        return torch.isfinite(x)

    def all_finite(self, x):
        # one read pass, no temporary: any inf/NaN makes the sum non-finite (an overflowing sum
        # of finite values says False too, which only costs the general path)
        return bool(torch.isfinite(x.sum()))

    def all_nonnegative(self, x):
        return bool((x.min() >= 0)) if x.numel() else True

    def topk_rows(self, score2d, k):
        return torch.topk(score2d, k, dim=-1, largest=True, sorted=True).indices.to(torch.int32)

    def gather_rows(self, x2d, idx2d):
        return torch.gather(x2d, -1, idx2d.long())

    def scatter_rows(self, rows, cols, idx2d, values2d):
        out = torch.zeros(rows, cols, dtype=torch.float32, device=values2d.device)
        return out.scatter_(-1, idx2d.long(), values2d.float())

    def assemble(self, n, dtype, pieces, like=None):
        out = torch.empty(n, dtype=_DT[dtype], device=like.device if like is not None else None)
        total = 0
        for off, x in pieces:
            k = x.numel()
            out[off:off + k].copy_(x.reshape(-1))
            total += k
        assert total == n, f"assemble: pieces hold {total} elements, expected {n}"
        return out

    def add_(self, a, b):
        return a.add_(b)

    def mul_(self, a, s):
        return a.mul_(s)

    def as_numpy(self, x):
        # CPU tensors only (a CUDA tensor gets no CPU kernel); bfloat16 has no numpy dtype
        if not isinstance(x, torch.Tensor) or x.device.type != "cpu" or x.dtype == torch.bfloat16:
            return None
        return x.detach().numpy()

    def from_numpy(self, a, like=None):
        t = torch.from_numpy(a)
        return t if like is None or like.device.type == "cpu" else t.to(like.device)

    # the low-rank codec's (powersgd) optional members
    def matmul(self, a, b):
        return torch.matmul(a, b)

    def transpose(self, x2d):
        return x2d.t().contiguous()  # thin factors only (cheap); a view would make matmul answer column-major

    def orthonormalize(self, x2d):
        if x2d.shape[1] > 2:
            return torch.linalg.qr(x2d).Q
        x = x2d.clone()
        for i in range(x.shape[1]):
            col = x[:, i:i + 1]
            # scaled by a power of two first, as the numpy reference (hvdp/ops.py): the float32
            # sum of squares would overflow above ~1.8e19 and underflow below ~1e-19
            big = col.abs().amax()
            exp = torch.frexp(big).exponent.clamp(-126, 126)
            one = torch.ones_like(big)
            col *= torch.where((big > 0) & torch.isfinite(big), torch.ldexp(one, -exp), one)
            norm = torch.linalg.vector_norm(col)
            col /= torch.where(norm > 0, norm, torch.ones_like(norm))  # a zero column stays zero
            if i + 1 < x.shape[1]:
                rest = x[:, i + 1:]
                rest -= torch.sum(col * rest, dim=0) * col
        return x
