"""The lossless property's batched half, shared by the decode tests of every speculation policy: a tree request
decoded beside another one (a shorter prompt, fewer tokens) gives the tokens each gives alone under plain AR."""
from __future__ import annotations

from kdtree.decode.request import Request
from kdtree.engine import AR_TREE


def assert_batched_equals_ar(engine, ids, tree, sampling, want, max_new: int = 48) -> None:
    """`want`: AR's tokens for (ids, max_new, sampling). Submits (ids, max_new) and (ids[3:], max_new // 2) with
    `tree`, drives them together, and compares each with its AR run."""
    reqs = [engine.submit(Request(ids, max_new, sampling=sampling, tree=tree)),
            engine.submit(Request(ids[3:], max_new // 2, sampling=sampling, tree=tree))]
    for r in reqs:
        engine.drive(r)
    assert reqs[0].result.tokens == want
    assert reqs[1].result.tokens == engine.generate(ids[3:], max_new // 2, tree=AR_TREE, sampling=sampling).tokens
