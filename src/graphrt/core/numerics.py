"""What "the same result" means for a padded step: the tolerance between two padded sizes.

The same step at the same bucket is bitwise the same, replayed or eager; at two buckets its
real outputs are within :func:`tolerance` with the same greedy tokens (another row count may
pick another matmul kernel); KV slots outside the step's are byte-identical (docs/padding.md).
This is the one place that bound is defined, for graphrt's tests and an engine's."""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import numpy as np

from graphrt.core.errors import ConfigError
from graphrt.core.kv_spec import kv_cache_dtype_name

#: ``graphrt.tolerance``: a step's real outputs at two padded sizes may differ by this many
#: eps of the accumulation dtype (float32; float64 for float64): another row count makes
#: the CPU GEMM / GPU BLAS pick another kernel, which sums the same products in another
#: order. Measured up to 14 eps (1.7e-6) on an AMD EPYC (MKL, every ATEN_CPU_CAPABILITY);
#: 64 eps is 7.6e-6, within the 1e-5 the tests allowed before this bound had one home.
TOLERANCE_ACCUMULATION_EPS = 64
#: ... or this many eps of a low-precision output dtype (bfloat16, float16), whichever is
#: larger: a reordered float32 sum can round to the neighbouring value of the output dtype,
#: once per op, and those one-eps flips carry through the layers.
TOLERANCE_ROUNDING_EPS = 4
#: ``graphrt.reduction_tolerance``: the reduced width ``TOLERANCE_ACCUMULATION_EPS`` was
#: calibrated on (the test models' hidden sizes); a wider reduction scales the bound by
#: sqrt(width / this), the growth of a reordered sum's rounding with its length.
TOLERANCE_CALIBRATION_WIDTH = 256

#: ``graphrt.tolerance``: machine epsilon (2**-mantissa bits) of the float dtypes it knows.
DTYPE_EPS: dict[str, float] = {"float64": 2.0**-52, "float32": 2.0**-23,
                               "float16": 2.0**-10, "bfloat16": 2.0**-7}
#: ``graphrt.core.numerics.kv_quantization_tolerance``: machine epsilon (2**-mantissa bits) of
#: the fp8 KV-cache formats; a stored value is off by at most half of it, relatively.
FP8_DTYPE_EPS: dict[str, float] = {"float8_e4m3fn": 2.0**-3, "float8_e5m2": 2.0**-2}
#: ... and how many of those eps attention over an fp8 cache may differ from attention over
#: the unquantized cache, relative to the outputs' magnitude (at least 1). Measured at most
#: 0.68 eps (float8_e4m3fn: 0.085) and 0.56 eps (float8_e5m2: 0.14) over 120 random steps
#: (head_dim 16-128, contexts up to 330, scales 0.25-3, windows), so 1 eps leaves a 1.5x margin.
KV_QUANTIZATION_TOLERANCE_EPS = 1.0


class Tolerance(NamedTuple):
    """``rtol`` / ``atol`` for ``np.testing.assert_allclose`` or ``torch.testing.assert_close``
    (``**tol._asdict()``)."""

    rtol: float
    atol: float


def dtype_name(dtype: Any) -> str:
    """``"float32"`` for ``torch.float32``, ``np.float32``, ``jnp.float32`` or ``"float32"``."""
    text = str(dtype)
    if text.startswith("torch."):
        return text.removeprefix("torch.")
    if isinstance(dtype, str) and (dtype in DTYPE_EPS or dtype in FP8_DTYPE_EPS):
        return dtype        # fp8 names: numpy knows them only once ml_dtypes (jax) is imported
    try:
        return np.dtype(dtype).name
    except TypeError as exc:
        raise ConfigError(f"not a dtype: {dtype!r}") from exc


def tolerance(dtype: Any = "float32") -> Tolerance:
    """How far a step's real outputs at two padded sizes may be apart, for outputs of ``dtype``.

    Another row count may pick another kernel, which sums the same products in another order.
    Two terms bound it: the accumulation, ``TOLERANCE_ACCUMULATION_EPS`` (64) eps of float32,
    7.6e-6, five times the largest difference measured on the test models (1.7e-6 on an AMD
    EPYC); and the output rounding of bfloat16 / float16, ``TOLERANCE_ROUNDING_EPS`` (4) eps of
    the dtype. The larger is both ``rtol`` and ``atol`` (compared values are O(1)): float32
    7.6e-6, float16 3.9e-3, bfloat16 3.1e-2, float64 1.4e-14. Calibrated on small models; for
    comparisons across shapes only (at one shape on a CPU results are bitwise equal).
    """
    name = dtype_name(dtype)
    eps = DTYPE_EPS.get(name)
    if eps is None:
        raise ConfigError(f"no tolerance for dtype {name}: one of {sorted(DTYPE_EPS)}")
    accumulation = DTYPE_EPS["float64" if name == "float64" else "float32"]
    bound = max(TOLERANCE_ACCUMULATION_EPS * accumulation, TOLERANCE_ROUNDING_EPS * eps)
    return Tolerance(rtol=bound, atol=bound)


def reduction_tolerance(dtype: Any = "float32", *, magnitude: float,
                        width: int = TOLERANCE_CALIBRATION_WIDTH) -> Tolerance:
    """How far outputs of the same computation with reductions in another order may be apart
    (tensor parallelism, a sharded XLA matmul, DP ranks at other shapes).

    A reordered sum rounds relative to its terms, so an output near 0 in a row reaching
    ``magnitude`` moves by about eps times ``magnitude`` (issue 26). ``rtol`` is
    :func:`tolerance`; ``atol`` is it scaled by ``magnitude`` (at least 1) and by
    ``sqrt(width / TOLERANCE_CALIBRATION_WIDTH)`` for a reduced dimension wider than the
    calibration. ``magnitude``: the reference's largest absolute value (per row or step).
    """
    if not np.isfinite(magnitude) or magnitude < 0:
        raise ConfigError(f"reduction_tolerance: magnitude must be finite and >= 0, got {magnitude!r}")
    if int(width) <= 0:
        raise ConfigError(f"reduction_tolerance: width must be > 0, got {width!r}")
    base = tolerance(dtype)
    widen = math.sqrt(max(int(width), TOLERANCE_CALIBRATION_WIDTH) / TOLERANCE_CALIBRATION_WIDTH)
    return Tolerance(rtol=base.rtol, atol=base.atol * max(1.0, float(magnitude)) * widen)


def kv_quantization_tolerance(kv_dtype: Any, *, magnitude: float) -> Tolerance:
    """How far attention over an fp8 KV cache may be from attention over the same values
    unquantized: each stored K/V value is off by up to half an fp8 eps (relatively), V's error
    carries straight into the output and K's into the softmax weights. The bound is
    ``KV_QUANTIZATION_TOLERANCE_EPS`` eps of ``kv_dtype`` (``FP8_DTYPE_EPS``)
    for ``rtol``, times ``max(1, magnitude)`` (the reference's largest absolute value) for
    ``atol``; it is far looser than :func:`tolerance`, which compares the same stored bytes.
    """
    try:
        name = kv_cache_dtype_name(kv_dtype)       # the config's spellings: "fp8", "fp8_e5m2", ...
    except ConfigError:
        name = dtype_name(kv_dtype)
    eps = FP8_DTYPE_EPS.get(name)
    if eps is None:
        raise ConfigError(f"no KV quantization tolerance for {name}: one of {sorted(FP8_DTYPE_EPS)}")
    if not np.isfinite(magnitude) or magnitude < 0:
        raise ConfigError(f"kv_quantization_tolerance: magnitude must be finite and >= 0, got {magnitude!r}")
    bound = KV_QUANTIZATION_TOLERANCE_EPS * eps
    return Tolerance(rtol=bound, atol=bound * max(1.0, float(magnitude)))


__all__ = ["Tolerance", "dtype_name", "kv_quantization_tolerance", "reduction_tolerance", "tolerance"]
