"""The Triton GGUF kernel against the reference (CPU tensors under TRITON_INTERPRET=1,
or a real GPU when present); tiny shapes because the interpreter is slow."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

SCRIPT = r"""
import torch
from pagedserve.kernels import quant_reference as ref
from pagedserve.kernels.triton.quant_gguf import gguf_linear_triton
from test_quant_kernels import random_gguf, rel_err
dev = "cuda" if torch.cuda.is_available() else "cpu"
gen = torch.Generator().manual_seed(0)
for t in ("Q4_0", "Q4_1", "Q8_0"):
    for m, n in ((1, 24), (5, 80)):
        raw = random_gguf(t, n, 64, gen)
        x = torch.randn(m, 64, generator=gen)
        b = torch.randn(n, generator=gen)
        out = gguf_linear_triton(x.to(dev), raw.to(dev), t, b.to(dev)).cpu()
        err = rel_err(out, ref.gguf_linear(x, raw, t, b))
        assert err < 1e-5, (t, m, n, err)
        # out_dtype: bf16 activations writing their float32 sums (a float32 residual stream).
        xb = x.bfloat16()
        out32 = gguf_linear_triton(xb.to(dev), raw.to(dev), t, b.to(dev), out_dtype=torch.float32).cpu()
        assert out32.dtype == torch.float32
        err = rel_err(out32, ref.gguf_linear(xb, raw, t, b, torch.float32))
        assert err < 1e-5, (t, m, n, "out_dtype", err)
        plain = gguf_linear_triton(xb.to(dev), raw.to(dev), t, b.to(dev)).cpu()
        assert plain.dtype == torch.bfloat16 and torch.equal(plain, out32.bfloat16())
print("ok")
"""

#: The extended types (Q5_x, K-quants: one super-block of 256 per row), random bytes with
#: realistic fp16 scales, so every bit of the 6-bit scale fields is exercised.
EXTENDED_SCRIPT = r"""
import torch
from pagedserve.kernels import quant_reference as ref
from pagedserve.kernels.triton.quant_gguf import gguf_linear_triton
from gguf_type_checks import random_blocks
from test_quant_kernels import rel_err
dev = "cuda" if torch.cuda.is_available() else "cpu"
gen = torch.Generator().manual_seed(1)
for t in ref.GGUF_EXTENDED_TYPES:
    k = ref.GGUF_BLOCK_VALUES[t] * 2 if t.endswith("_K") else 96
    for m, n in ((1, 24), (3, 40)):
        raw = random_blocks(t, n, k, gen)
        x = torch.randn(m, k, generator=gen)
        b = torch.randn(n, generator=gen)
        out = gguf_linear_triton(x.to(dev), raw.to(dev), t, b.to(dev)).cpu()
        err = rel_err(out, ref.gguf_linear(x, raw, t, b))
        assert err < 1e-5, (t, m, n, err)
try:
    gguf_linear_triton(torch.randn(1, 96).to(dev), random_blocks("Q4_K", 4, 256, gen)[:, :60].to(dev), "Q4_K")
    raise SystemExit("a K-quant row of 96 values was accepted")
except ValueError:
    pass
print("ok")
"""


@pytest.mark.parametrize("script", [SCRIPT, EXTENDED_SCRIPT], ids=["base", "extended"])
def test_quant_triton_gguf_interpreted(script):
    # A subprocess: TRITON_INTERPRET must be set before triton is imported.
    here = os.path.dirname(__file__)
    # test_quant_kernels imports tests/native_build.py: tests/ on the path, as under pytest.
    path = os.pathsep.join(p for p in (os.path.dirname(here), os.environ.get("PYTHONPATH")) if p)
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=path)
    proc = subprocess.run(
        [sys.executable, "-c", script], cwd=here, env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr[-3000:]
