"""OpenAI logprobs objects from a real sampled generation on the trained tiny model (kdtree/serve/logprobs.py):
the legacy completions layout with echo, and the chat layout with bytes.

Run: .venv/bin/python -m pytest -q tests/serve/test_logprobs_format.py
"""
from __future__ import annotations

import math

import pytest

from kdtree.decode.sampling import SamplingParams
from kdtree.engine import Engine
from kdtree.serve.logprobs import chat_logprobs, completion_logprobs


@pytest.fixture(scope="module")
def generated(kdtree_cache):
    from hydra import compose, initialize_config_dir
    from kdtree.pipeline.registry import register_schema as register
    from tests.conftest import REPO

    register()
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=[f"cache_dir={kdtree_cache}", "load.progress=false"])
    eng = Engine.from_config(cfg)
    ids = eng.tokenizer.encode("def f(x):")
    r = eng.generate(ids, 10, sampling=SamplingParams(temperature=0.9, seed=5, logprobs=3, echo=True))
    yield eng, ids, r
    eng.close()


def test_completions_layout_with_echo(generated):
    eng, ids, r = generated
    lp = completion_logprobs(eng.tokenizer, r, prompt_ids=ids)
    n = len(ids) + len(r.tokens)
    assert all(len(lp[k]) == n for k in ("tokens", "token_logprobs", "top_logprobs", "text_offset"))
    assert "".join(lp["tokens"]) == "def f(x):" + eng.tokenizer.decode(r.tokens)
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None     # the first prompt token
    assert lp["token_logprobs"][len(ids):] == [e["logprob"] for e in r.logprobs]
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(n)]
    for top in lp["top_logprobs"][1:]:
        assert len(top) == 3 and list(top.values()) == sorted(top.values(), reverse=True)
        assert all(v <= 0 for v in top.values()) and math.fsum(math.exp(v) for v in top.values()) <= 1 + 1e-9
    plain = completion_logprobs(eng.tokenizer, r, text_offset=len("def f(x):"))
    assert plain["tokens"] == lp["tokens"][len(ids):] and plain["text_offset"] == lp["text_offset"][len(ids):]


def test_chat_layout(generated):
    eng, ids, r = generated
    content = chat_logprobs(eng.tokenizer, r)["content"]
    assert [c["logprob"] for c in content] == [e["logprob"] for e in r.logprobs]
    assert b"".join(bytes(c["bytes"]) for c in content) == b"".join(eng.tokenizer.token_bytes(t) for t in r.tokens)
    assert all(len(c["top_logprobs"]) == 3 and set(c["top_logprobs"][0]) == {"token", "logprob", "bytes"}
               for c in content)
    assert chat_logprobs(eng.tokenizer, eng.generate(ids, 3)) == {"content": []}   # not asked: empty
