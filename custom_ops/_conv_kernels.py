"""The Triton kernels of custom_ops/grouped_conv1d_triton.py (read its docstring), in a module
of their own: triton.jit decides when it decorates whether a kernel runs on the device or under
the interpreter, so the wrapper loads this file once for each (`_kernels`)."""
import triton
import triton.language as tl


@triton.jit
def _valid(rows, taps, R, S, mask_ptr, P: tl.constexpr, MODE: tl.constexpr, BACKWARD: tl.constexpr):
    """(BLOCK, KP) whether tap k of row r pairs it with a neighbour: forward, the input row
    r + k − P read by output row r; backward, the output row r − k + P that read input row r.
    Returns the neighbour rows and the pairs' validity (the taps beyond K are cut by the caller)."""
    seq = rows % S
    if BACKWARD:
        near = rows[:, None] - taps[None, :] + P
        pos = seq[:, None] - taps[None, :] + P
    else:
        near = rows[:, None] + taps[None, :] - P
        pos = seq[:, None] + taps[None, :] - P
    ok = (rows[:, None] < R) & (pos >= 0) & (pos < S)
    if MODE == 2:  # packed: same sequence, not padding
        own = tl.load(mask_ptr + rows, mask=rows < R, other=0)
        other = tl.load(mask_ptr + near, mask=ok, other=0)
        ok = ok & (other == own[:, None]) & (own[:, None] != 0)
    elif MODE == 1:
        if not BACKWARD:  # the input row is masked (backward: the row's own, after the dot)
            ok = ok & (tl.load(mask_ptr + near, mask=ok, other=0) != 0)
    return near, ok


@triton.jit
def _unfolded(src_ptr, near, ok, col0, H, C: tl.constexpr, CP: tl.constexpr, KP: tl.constexpr,
              BLOCK: tl.constexpr):
    """(BLOCK, KP·CP): [r, k·CP + c] = src[near[r, k], col0 + c] where ok, else 0."""
    c = tl.arange(0, CP)
    offsets = near[:, :, None] * H + col0 + c[None, None, :]
    valid = ok[:, :, None] & (c[None, None, :] < C)
    tile = tl.load(src_ptr + offsets, mask=valid, other=0.0)  # (BLOCK, KP, CP)
    return tl.reshape(tile, (BLOCK, KP * CP))


@triton.jit
def _weights(w_ptr, g, C: tl.constexpr, K: tl.constexpr, CP: tl.constexpr, KP: tl.constexpr,
             TRANSPOSED: tl.constexpr):
    """(KP·CP, CP): [k·CP + c, j] = W[g·C + j, c, k] (forward), or with TRANSPOSED
    [k·CP + j, c] = W[g·C + j, c, k] (dx); zero beyond C and K."""
    q = tl.arange(0, KP * CP)
    k, inner = q // CP, q % CP
    outer = tl.arange(0, CP)
    if TRANSPOSED:
        offsets = (g * C + inner[:, None]) * (C * K) + outer[None, :] * K + k[:, None]
    else:
        offsets = (g * C + outer[None, :]) * (C * K) + inner[:, None] * K + k[:, None]
    valid = (k[:, None] < K) & (inner[:, None] < C) & (outer[None, :] < C)
    return tl.load(w_ptr + offsets, mask=valid, other=0.0)


@triton.jit
def _dot(a, b, UPCAST: tl.constexpr, IEEE: tl.constexpr):
    if UPCAST:
        a, b = a.to(tl.float32), b.to(tl.float32)
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def rows_pass(src_ptr, w_ptr, mask_ptr, out_ptr, R, S, H, C: tl.constexpr, K: tl.constexpr, CP: tl.constexpr,
              KP: tl.constexpr, BLOCK: tl.constexpr, MODE: tl.constexpr, BACKWARD: tl.constexpr,
              UPCAST: tl.constexpr, IEEE: tl.constexpr):
    """BLOCK rows of one group: the forward pass (y from x and W) or, with BACKWARD, grad-input
    (dx from dy and the transposed W, the neighbours on the other side; zero on masked rows)."""
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    g = tl.program_id(1)
    taps = tl.arange(0, KP)
    near, ok = _valid(rows, taps, R, S, mask_ptr, K // 2, MODE, BACKWARD)
    ok = ok & (taps[None, :] < K)
    tile = _unfolded(src_ptr, near, ok, g * C, H, C, CP, KP, BLOCK)
    out = _dot(tile, _weights(w_ptr, g, C, K, CP, KP, BACKWARD), UPCAST, IEEE)  # (BLOCK, CP)
    if BACKWARD:
        if MODE == 1:  # x was masked: a padded row gets no gradient
            own = tl.load(mask_ptr + rows, mask=rows < R, other=0)
            out = tl.where((own != 0)[:, None], out, 0.0)
    c = tl.arange(0, CP)
    tl.store(out_ptr + rows[:, None] * H + g * C + c[None, :], out.to(out_ptr.dtype.element_ty),
             mask=(rows[:, None] < R) & (c[None, :] < C))


@triton.jit
def grad_w(dy_ptr, x_ptr, mask_ptr, part_ptr, R, S, H, C: tl.constexpr, K: tl.constexpr, CP: tl.constexpr,
           KP: tl.constexpr, BLOCK: tl.constexpr, BLOCKS, MODE: tl.constexpr,
           UPCAST: tl.constexpr, IEEE: tl.constexpr):
    """part[chunk, g] (CP, KP·CP) = Σ over the chunk's BLOCKS·BLOCK rows of dyᵀ · x unfolded."""
    chunk, g = tl.program_id(0), tl.program_id(1)
    G = tl.num_programs(1)
    taps = tl.arange(0, KP)
    j = tl.arange(0, CP)
    # tl.full, a builtin: tl.zeros is a jit function of Triton's standard library, which the
    # interpreter cannot call where triton was imported without it (custom_ops/triton_support.py).
    acc = tl.full((CP, KP * CP), 0.0, tl.float32)
    for i in range(BLOCKS):
        rows = (chunk * BLOCKS + i) * BLOCK + tl.arange(0, BLOCK)
        near, ok = _valid(rows, taps, R, S, mask_ptr, K // 2, MODE, False)
        ok = ok & (taps[None, :] < K)
        xs = _unfolded(x_ptr, near, ok, g * C, H, C, CP, KP, BLOCK)  # (BLOCK, KP·CP)
        dy = tl.load(dy_ptr + rows[:, None] * H + g * C + j[None, :],
                     mask=(rows[:, None] < R) & (j[None, :] < C), other=0.0)  # (BLOCK, CP)
        acc += _dot(tl.trans(dy), xs, UPCAST, IEEE)
    q = tl.arange(0, KP * CP)
    tl.store(part_ptr + ((chunk * G + g) * CP + j[:, None]) * (KP * CP) + q[None, :], acc)
