"""The Triton kernels of session/add_norm.py (read its docstring), loaded by
custom_ops.triton_support.load_kernels for the device or the interpreter."""
import triton
import triton.language as tl


@triton.jit
def _add(a, b):
    return a + b


@triton.jit
def _sum(v):
    """The sum of a row: tl.reduce with a combine of our own, not tl.sum (read
    custom_ops/triton_support.py: the interpreter cannot call Triton's own jit functions)."""
    return tl.reduce(v, 0, _add)


@triton.jit
def _round(v, DTYPE: tl.constexpr):
    """float32 `v` rounded to DTYPE, to nearest even (bf16 by its bits: the interpreter's cast
    truncates; the device's cast rounds the same way)."""
    if DTYPE == tl.bfloat16:
        bits = v.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True).to(tl.bfloat16)
    return v.to(DTYPE)


@triton.jit
def forward(a_ptr, b_ptr, w_ptr, bias_ptr, s_ptr, y_ptr, mean_ptr, rstd_ptr, H, eps, BLOCK: tl.constexpr):
    """One row: s = a + b rounded to s's dtype (as torch's add), y = layer norm(s) in float32,
    rounded to y's dtype; s, y, the mean and 1/σ stored."""
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    inside = cols < H
    a = tl.load(a_ptr + row * H + cols, mask=inside, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + row * H + cols, mask=inside, other=0.0).to(tl.float32)
    s = _round(a + b, s_ptr.dtype.element_ty)
    tl.store(s_ptr + row * H + cols, s, mask=inside)
    s = s.to(tl.float32)
    mean = _sum(s) / H
    centred = tl.where(inside, s - mean, 0.0)
    rstd = 1.0 / tl.sqrt(_sum(centred * centred) / H + eps)
    w = tl.load(w_ptr + cols, mask=inside, other=0.0).to(tl.float32)
    bias = tl.load(bias_ptr + cols, mask=inside, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * H + cols, _round(centred * rstd * w + bias, y_ptr.dtype.element_ty), mask=inside)
    tl.store(mean_ptr + row, mean)
    tl.store(rstd_ptr + row, rstd)


@triton.jit
def backward(dy_ptr, s_ptr, w_ptr, mean_ptr, rstd_ptr, extra_ptr, ds_ptr, part_ptr, R, H, ROWS,
             BLOCK: tl.constexpr, EXTRA: tl.constexpr):
    """ROWS rows: ds = layer norm's input gradient (+ the sum's gradient from its other readers,
    EXTRA), rounded to ds's dtype; the program's float32 sums of dy·ŝ and dy (the weight's and
    the bias's gradients) into part[program]."""
    program = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    inside = cols < H
    w = tl.load(w_ptr + cols, mask=inside, other=0.0).to(tl.float32)
    dw = tl.full((BLOCK,), 0.0, tl.float32)
    db = tl.full((BLOCK,), 0.0, tl.float32)
    for i in range(tl.minimum(ROWS, R - program * ROWS)):
        row = program * ROWS + i
        s = tl.load(s_ptr + row * H + cols, mask=inside, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + row * H + cols, mask=inside, other=0.0).to(tl.float32)
        mean = tl.load(mean_ptr + row)
        rstd = tl.load(rstd_ptr + row)
        normed = tl.where(inside, (s - mean) * rstd, 0.0)
        wdy = w * dy
        c1 = _sum(normed * wdy) / H
        c2 = _sum(wdy) / H
        ds = (wdy - (normed * c1 + c2)) * rstd
        if EXTRA:
            ds += tl.load(extra_ptr + row * H + cols, mask=inside, other=0.0).to(tl.float32)
        tl.store(ds_ptr + row * H + cols, _round(ds, ds_ptr.dtype.element_ty), mask=inside)
        dw += dy * normed
        db += dy
    tl.store(part_ptr + (2 * program) * BLOCK + cols, dw)
    tl.store(part_ptr + (2 * program + 1) * BLOCK + cols, db)
