"""Device helpers shared by the Triton kernels: float32 -> float8 e4m3 the way torch rounds."""

from .runtime import tl, triton


@triton.jit
def to_fp8(x, EXACT: tl.constexpr):
    """Saturate to +-448 and round to float8 e4m3 (round to nearest even)."""
    x = tl.minimum(tl.maximum(x, -448.0), 448.0)
    if EXACT:
        # Add and subtract 1.5 * 2^(ulp + 23): float32 addition rounds |x| to a
        # multiple of e4m3's spacing 2^ulp, ulp = max(exponent, -6) - 3. The sign is
        # put back from x's sign bit, so what underflows keeps it (-0.0, as torch gives).
        bits = x.to(tl.int32, bitcast=True)
        biased = tl.maximum((bits >> 23) & 0xFF, 121)
        magic = (((biased + 20) << 23) | 0x400000).to(tl.float32, bitcast=True)
        r = (tl.abs(x) + magic) - magic
        x = (r.to(tl.int32, bitcast=True) | (bits & -2147483648)).to(tl.float32, bitcast=True)
    return x.to(tl.float8e4nv)
