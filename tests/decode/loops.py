"""The decoder's configurations the tests name: AR and chain/DDTree are `kdtree.decode.generate` with a tree config
(one decode round, kdtree/decode/state.py); these two spell the tree kind out at the call site."""
from __future__ import annotations

from omegaconf import OmegaConf

from kdtree.decode import generate

AR = OmegaConf.create({"kind": "ar", "width": 1, "depth": 0, "budget": 0})


def generate_ar(model, prompt_ids, max_new_tokens, **kw):
    return generate(model, None, AR, prompt_ids, max_new_tokens, **kw)


def generate_ddtree(model, drafter, tree_cfg, prompt_ids, max_new_tokens, **kw):
    return generate(model, drafter, tree_cfg, prompt_ids, max_new_tokens, **kw)
