"""backend=cpu (the compiled native library) runs the whole tiny model and gives the same tokens as the
numpy reference, fp32 and INT4, for AR and DDTree (issue 7's end-to-end acceptance)."""
from __future__ import annotations

import pytest

from kdtree.engine import Engine
from tests.native_lib import needs_cpu_library

pytestmark = needs_cpu_library
PROMPTS = ["2+2=", "def __init__(self, ", "The quick brown fox", "\x00\x01abc\xff", "import os\n"]


@pytest.mark.parametrize("quant", ["fp32", "int4_w4a16"])
def test_cpu_tokens_equal_numpy_tokens(compose_cfg, quant):
    tokens = {}
    for backend in ("numpy", "cpu"):
        engine = Engine.from_config(compose_cfg(f"quant={quant}", f"backend={backend}", "tree=ddtree",
                                                "tree.width=2", "tree.depth=3", "tree.budget=6", "load.progress=false"))
        assert type(engine.model.ops).__name__ == ("NumpyOps" if backend == "numpy" else "NativeOps")
        tokens[backend] = [engine.generate(engine.tokenizer.encode(p), 20).tokens for p in PROMPTS]
    assert tokens["cpu"] == tokens["numpy"]
