"""The Target / Drafter protocols and their factory on the numpy backend (no native library needed): build_target
picks K2Model, build_drafter DFlashDrafter, and every peer (TPModel too) has what decode and the engine call.
The native picks (backend=cpu): tests/native/test_native_forward.py."""
from __future__ import annotations

import numpy as np

from kdtree.backends.numpy_ops import NumpyOps
from kdtree.model.drafter import DFlashDrafter
from kdtree.model.k2 import K2Model
from kdtree.model.names import drafter_tensor_shapes, init_weights
from kdtree.model.target import Drafter, Target, build_drafter, build_target
from kdtree.parallel.model import TPModel


def test_numpy_backend_builds_the_reference_peers(tiny_cfg, tiny_weights):
    target = build_target(tiny_cfg, tiny_weights, NumpyOps())
    assert type(target) is K2Model and isinstance(target, Target)
    drafter = build_drafter(tiny_cfg, init_weights(drafter_tensor_shapes(tiny_cfg), seed=1), target)
    assert type(drafter) is DFlashDrafter and isinstance(drafter, Drafter)
    assert drafter.embed is target.embed_tokens and drafter.lm_head is target.lm_head_w   # shared, not copied
    # the engine's hooks answer "nothing native here" instead of being probed for; the paged arena is numpy's own
    assert not target.graph_rows([1, 9]) and not target.attach_device_collective()
    assert target.reserve_cache_pool(64) and target.pages.total == 4 and target.arena.shape[:3] == (4, 4, 16)   # [L, p, P]
    assert target.graph_stats() == {"graphs": 0, "replays": 0, "eager": 0, "buckets": 0, "capture_s": 0.0}
    logits, hid = target.forward(np.array([1, 2, 3], np.int32), np.arange(3), target.new_cache(8), hidden_layers=(1,))
    assert logits.shape == (3, tiny_cfg.vocab_size) and hid[1].shape == (3, tiny_cfg.hidden_size)


def test_the_tensor_parallel_proxy_is_a_target(tiny_cfg, tiny_weights):
    local = build_target(tiny_cfg, tiny_weights, NumpyOps())
    proxy = TPModel(local, [], 1, [0])
    assert isinstance(proxy, Target)
    assert proxy.embed_tokens is local.embed_tokens and proxy.ops is local.ops
    assert not proxy.graph_rows([1]) and proxy.graph_stats()["graphs"] == 0
    assert proxy.reserve_cache_pool(64) and proxy.pages is local.pages and proxy.pages.total == 4  # rank 0's pool
