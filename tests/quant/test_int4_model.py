"""The embedded tiny K2 with INT4 routed experts (the K2.6 layout) against the same model in FP32, on a fixed text.

The embedded tiny checkpoint is the trained one (kdtree/assets/tiny): measured agreement on TEXT is 0.954 of
positions (1.0 where FP32 is confident, FP32's argmax always in INT4's top 5), and 0.98 on 400 bytes of held-out
stdlib source (heapq.py). On random-init weights (logit gaps ~0.2 vs INT4 noise ~0.3) it was only ~0.6.
"""

import numpy as np
import pytest

from kdtree.backends.numpy_ops import NumpyOps
from kdtree.checkpoint.loader import load_checkpoint
from kdtree.checkpoint.tiny import ensure_tiny_checkpoint
from kdtree.config.schema import group_config
from kdtree.model.k2 import K2Model
from kdtree.quant.int4 import Int4Weight

TEXT = b"The quick brown fox jumps over the lazy dog. 2+2=4, and kdtree serves Kimi K2 on a CPU."
MIN_AGREE = 0.9          # exact argmax agreement over all positions (0.954 measured on the trained tiny)
MIN_CONFIDENT = 0.97     # ... where FP32's top-1 leads top-2 by > 0.5 logits (1.0 measured)
MIN_TOP5 = 0.98          # FP32's argmax is among INT4's top 5 (1.0 measured)


def _forward(model_cfg, weights):
    tokens = np.frombuffer(TEXT, np.uint8).astype(np.int32)              # byte tokens [T]
    model = K2Model(model_cfg, weights, NumpyOps())
    logits, _ = model.forward(tokens, np.arange(len(tokens)), model.new_cache(len(tokens)))
    return logits                                                         # [T, V]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, make_quant_cfg):
    cache = str(tmp_path_factory.mktemp("cache"))
    model_cfg = group_config("model", "tiny")   # all layers (this package's tiny_cfg has 2)
    quant = make_quant_cfg("int4_w4a16")
    fp32_w, _ = load_checkpoint(ensure_tiny_checkpoint(model_cfg, None, cache), model_cfg, None)
    int4_w, _ = load_checkpoint(ensure_tiny_checkpoint(model_cfg, quant, cache), model_cfg, quant)
    deq_w = {k: v.dequantize() if isinstance(v, Int4Weight) else v for k, v in int4_w.items()}
    n_int4 = sum(isinstance(v, Int4Weight) for v in int4_w.values())
    return dict(fp32=_forward(model_cfg, fp32_w), int4=_forward(model_cfg, int4_w),
                deq=_forward(model_cfg, deq_w), n_int4=n_int4)


def test_int4_forward_equals_fp32_forward_on_the_dequantized_weights(runs):
    assert runs["n_int4"] == 3 * 8 * 3                                     # routed experts of 3 MoE layers
    np.testing.assert_allclose(runs["int4"], runs["deq"], rtol=1e-4, atol=1e-4)
    assert (runs["int4"].argmax(-1) == runs["deq"].argmax(-1)).mean() >= 0.98


def test_int4_argmax_agrees_with_fp32(runs):
    fp32, int4 = runs["fp32"], runs["int4"]
    a, b = fp32.argmax(-1), int4.argmax(-1)
    top2 = np.sort(fp32, axis=-1)[:, -2:]
    confident = top2[:, 1] - top2[:, 0] > 0.5
    top5 = np.argsort(-int4, axis=-1)[:, :5]
    assert (a == b).mean() >= MIN_AGREE
    assert confident.sum() >= 10 and (a[confident] == b[confident]).mean() >= MIN_CONFIDENT
    assert np.mean([a[t] in top5[t] for t in range(len(a))]) >= MIN_TOP5
    assert np.abs(int4 - fp32).std() < 0.5 * fp32.std()                  # INT4 noise, not a different model
