"""What "the same result" means for a padded step: the tolerance between two padded sizes.

graphrt's padding guarantees (docs/padding.md):

* the same step padded to the same bucket is bitwise the same, replayed or eager, run
  once or twice: the same kernels run on the same rows;
* the same step padded to two different buckets gives real outputs (hidden rows, logits,
  KV writes) within :func:`tolerance` of each other, and the same greedy tokens: another
  row count may select another matmul kernel, which adds the same products in another
  order, so the last bits can differ;
* KV slots outside the step's real slots are byte-identical, whatever the bucket.

:func:`tolerance` is the one place the second bound is defined; graphrt's own tests use it
and so can an engine's.
"""

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

    A different row count may make the matmul pick a different kernel (CPU GEMMs choose by
    shape, so do GPU BLAS heuristics), which adds the same products in a different order.
    The results then differ by rounding only, and that rounding is bounded by two terms:

    * the accumulation: matmuls sum in float32 (float64 for float64 inputs), and a
      reordered sum of K products differs by about sqrt(K) eps of that dtype, growing
      through the layers; ``TOLERANCE_ACCUMULATION_EPS`` (64) eps of float32 is
      7.6e-6, five times the largest difference measured between a padded and an unpadded
      step of the test models (1.7e-6, 14 eps, on an AMD EPYC whose MKL picks other
      kernels for other row counts);
    * the output rounding: bfloat16 / float16 results are rounded to their own few bits
      after each op, so a tiny accumulation difference can move an output to the
      neighbouring representable value, and those flips carry through the layers;
      ``TOLERANCE_ROUNDING_EPS`` (4) eps of the output dtype.

    The larger term is both ``rtol`` and ``atol`` (graphrt compares normalised hidden
    states, logits and K/V rows, whose values are O(1)): float32 7.6e-6, float16 3.9e-3,
    bfloat16 3.1e-2, float64 1.4e-14. It is calibrated on short sums (hidden sizes of
    hundreds, a few layers); a model thousands wide and dozens of layers deep accumulates
    more and may need a looser bound. It is for comparisons across shapes only: at the
    same padded shape on a CPU graphrt's results are bitwise equal.
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
    """How far outputs of the same computation with its reductions in another order may be
    apart: tensor parallelism (each rank sums its shard, then the all-reduce adds the
    partial sums), a sharded XLA matmul, or data-parallel ranks padding to other shapes.

    A reordered sum rounds relative to the terms it adds, not to its result, so an output
    near 0 in a row whose other outputs reach ``magnitude`` can move by about eps times
    ``magnitude`` (issue 26: a logit of 0.0054 moved by 9.1e-6 in a row reaching 20, over
    :func:`tolerance`'s 7.6e-6). The bound is therefore :func:`tolerance` of ``dtype`` for
    ``rtol``, and for ``atol`` the same bound scaled by the magnitude of the compared values
    (at least 1: :func:`tolerance` already covers O(1) values) and by
    ``sqrt(width / TOLERANCE_CALIBRATION_WIDTH)`` for a reduction wider than the ones
    :func:`tolerance` was calibrated on (``width``: the reduced dimension, e.g. the hidden
    size; at most the calibration width counts as it).

    ``magnitude`` is the largest absolute value of the reference (per row or per step, as
    the caller compares).
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
