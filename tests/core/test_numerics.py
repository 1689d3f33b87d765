"""``graphrt.tolerance``: the one bound for a step's outputs across padded sizes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import graphrt
from graphrt.core import numerics
from graphrt.core.numerics import TOLERANCE_CALIBRATION_WIDTH
from graphrt.core.errors import ConfigError


def test_values_follow_the_dtype() -> None:
    f32, f16, bf16, f64 = (graphrt.tolerance(d) for d in ("float32", "float16", "bfloat16", "float64"))
    assert f32 == (64 * 2.0**-23, 64 * 2.0**-23) and f32.rtol == pytest.approx(7.63e-6, rel=1e-3)
    assert f16.rtol == 4 * 2.0**-10 and bf16.rtol == 4 * 2.0**-7
    assert f64.rtol == 64 * 2.0**-52
    assert f64.rtol < f32.rtol < f16.rtol < bf16.rtol
    assert all(t.rtol == t.atol for t in (f32, f16, bf16, f64))
    assert f32.rtol < 1e-5   # no tighter test was loosened when this bound got one home


def test_accepts_torch_numpy_jax_and_names() -> None:
    want = graphrt.tolerance("float32")
    assert graphrt.tolerance(torch.float32) == graphrt.tolerance(np.float32) == want
    assert graphrt.tolerance(np.dtype("float32")) == graphrt.tolerance() == want
    assert graphrt.tolerance(torch.bfloat16) == graphrt.tolerance("bfloat16")
    jnp = pytest.importorskip("jax.numpy")
    assert graphrt.tolerance(jnp.float32) == want
    assert graphrt.tolerance(jnp.bfloat16) == graphrt.tolerance(torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.int32, "int8", "not a dtype"])
def test_rejects_what_it_cannot_bound(dtype: object) -> None:
    with pytest.raises(ConfigError, match="dtype"):
        graphrt.tolerance(dtype)


def test_the_tolerance_reads_its_constants_at_call_time(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(numerics, "TOLERANCE_ACCUMULATION_EPS", 128)
    assert graphrt.tolerance("float32").rtol == 128 * 2.0**-23
    monkeypatch.setattr(numerics, "TOLERANCE_ROUNDING_EPS", 8)
    assert graphrt.tolerance("bfloat16").rtol == 8 * 2.0**-7


def test_bounds_a_reordered_float32_sum() -> None:
    """The same products summed in another order stay within the bound (what another
    matmul kernel does), and a real change of one ulp in every input does not."""
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((64, 512), dtype=np.float32), rng.standard_normal((512, 64), dtype=np.float32)
    b /= np.sqrt(512)
    forward = a @ b
    blocked = sum(a[:, k:k + 7] @ b[k:k + 7] for k in range(0, 512, 7))
    tol = graphrt.tolerance(np.float32)
    np.testing.assert_allclose(blocked, forward, **tol._asdict())
    assert not np.array_equal(blocked, forward)
    assert not np.allclose(forward * (1 + 1e-3), forward, **tol._asdict())


def test_reduction_tolerance_scales_with_the_values_summed() -> None:
    """Issue 26's fresh-clone failure: a tensor-parallel logit of 0.00536245 against the single
    device's 0.00537151 (9.06e-6 apart) in a row reaching 20 is a reordering, not a bug: outside
    ``tolerance`` (7.63e-6), inside ``reduction_tolerance``; a real error of 1e-3 is not."""
    got, want = np.array([0.00536245, 20.0], np.float32), np.array([0.00537151, 20.0], np.float32)
    plain = graphrt.tolerance("float32")
    assert not np.allclose(got, want, rtol=plain.rtol, atol=plain.atol)
    tol = graphrt.reduction_tolerance("float32", magnitude=float(np.abs(want).max()), width=64)
    np.testing.assert_allclose(got, want, **tol._asdict())
    assert not np.allclose(want + np.array([1e-3, 0], np.float32), want, **tol._asdict())
    assert tol.rtol == plain.rtol and tol.atol == pytest.approx(20 * plain.atol)
    # O(1) values keep the plain bound; a wider reduction widens it by sqrt(width / calibration)
    assert graphrt.reduction_tolerance("float32", magnitude=0.5) == plain
    wide = graphrt.reduction_tolerance("float32", magnitude=1.0, width=4 * TOLERANCE_CALIBRATION_WIDTH)
    assert wide.atol == pytest.approx(2 * plain.atol)
    assert graphrt.reduction_tolerance("bfloat16", magnitude=2.0).atol == 2 * graphrt.tolerance("bfloat16").atol


@pytest.mark.parametrize("bad", [dict(magnitude=float("nan")), dict(magnitude=-1.0), dict(magnitude=1.0, width=0)])
def test_reduction_tolerance_refuses_nonsense(bad: dict) -> None:
    with pytest.raises(ConfigError, match="reduction_tolerance"):
        graphrt.reduction_tolerance("float32", **bad)


def test_reordered_wide_sums_stay_within_the_reduction_bound() -> None:
    """A tensor-parallel row: each of 4 ranks sums its quarter of a 1024-wide product, then the
    partial sums are added; the result differs from the one-device sum within the bound."""
    rng = np.random.default_rng(1)
    x, w = rng.standard_normal((32, 1024), dtype=np.float32), rng.standard_normal((1024, 512), dtype=np.float32)
    w *= 8 / np.sqrt(1024)                      # outputs reaching ~30, like a logit row
    whole = x @ w
    parts = sum(x[:, r * 256:(r + 1) * 256] @ w[r * 256:(r + 1) * 256] for r in (3, 1, 0, 2))
    tol = graphrt.reduction_tolerance(np.float32, magnitude=float(np.abs(whole).max()), width=1024)
    np.testing.assert_allclose(parts, whole, **tol._asdict())


def test_fp8_names_need_no_ml_dtypes() -> None:
    """numpy knows "float8_e4m3fn" only once ml_dtypes (jax) is imported: the fp8 tolerance of a
    torch-only process named its dtype by string and got ``ConfigError: not a dtype``."""
    import subprocess
    import sys

    code = ("import sys; from graphrt.core.numerics import kv_quantization_tolerance as k; "
            "print(k('float8_e4m3fn', magnitude=1.0).rtol, k('float8_e5m2', magnitude=1.0).rtol, "
            "'ml_dtypes' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["0.125", "0.25", "False"]
