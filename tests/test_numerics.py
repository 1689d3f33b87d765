"""``graphrt.tolerance``: the one bound for a step's outputs across padded sizes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import graphrt
from graphrt.core import defaults
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


def test_numbers_live_in_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(defaults, "TOLERANCE_ACCUMULATION_EPS", 128)
    assert graphrt.tolerance("float32").rtol == 128 * 2.0**-23
    monkeypatch.setattr(defaults, "TOLERANCE_ROUNDING_EPS", 8)
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
