"""transformers is optional: mxmoe imports and converts plain models without it."""

from __future__ import annotations

import subprocess
import sys

SCRIPT = """
import sys
sys.modules["transformers"] = None  # import transformers now raises ImportError
import torch, mxmoe, mxmoe.integrations
model = torch.nn.Sequential(torch.nn.Linear(64, 64))
mxmoe.convert_to_mxfp8(model)
assert type(model[0]).__name__ == "MXLinear"
try:
    import mxmoe.integrations.transformers
except ImportError:
    print("ok")
"""


def test_mxmoe_imports_and_converts_without_transformers():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
