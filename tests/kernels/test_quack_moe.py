"""QuACK's GEMMs of mxmoe.kernels.quack_moe compile for sm90 (no GPU needed; needs the
``hopper`` extra, so CI, which does not install it, skips this)."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).with_name("quack_sm90_compile.py")


@pytest.mark.skipif(importlib.util.find_spec("quack") is None, reason="quack-kernels not installed (mxmoe[hopper])")
def test_every_quack_gemm_of_the_moe_layer_compiles_for_sm90():
    """Each wrapper's exact arguments traced, lowered and compiled to an sm_90a cubin
    (quack_sm90_compile.py; a wrong dtype there fails with QuACK's TypeError)."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, env=env, timeout=900)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    assert "compiled: 6" in r.stdout
