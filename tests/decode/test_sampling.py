"""Sampling (kdtree/decode/sampling.py): the counter-based stream, the processed distribution (vLLM's
penalties, temperature, top-k, top-p), a chi-square test of the first sampled token over many seeds, the
temperature -> 0 limit, logprobs/echo against a reference forward, n samples sharing one prefill, and the
SamplingParams API the HTTP front end calls (one-line errors naming the field).

Run: .venv/bin/python -m pytest -q tests/decode/test_sampling.py
"""
from __future__ import annotations

import math

import numpy as np
import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from kdtree.pipeline.registry import register_schema as register
from kdtree.decode import generate, generate_n
from kdtree.decode.sampling import (SamplingError, SamplingParams, Sampler, distribution, log_softmax,
                                    penalized_logits, random_bits, sample_seed, sample_token, top_ids,
                                    uniform)
from kdtree.engine import Engine
from tests.conftest import REPO

AR = OmegaConf.create({"kind": "ar", "width": 1, "depth": 0, "budget": 0})


@pytest.fixture(scope="module")
def engine(kdtree_cache):
    """The trained tiny model (the embedded checkpoint) with its DFlash drafter, numpy backend."""
    register()
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=[f"cache_dir={kdtree_cache}", "pipeline=generate"])
    eng = Engine.from_config(cfg)
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def prompt_logits(engine):
    """The prefill's last logits row f32[V] of a code prompt: the first generated token's distribution."""
    ids = engine.tokenizer.encode("def __init__(self, ")
    logits, _ = engine.model.forward(np.asarray(ids, np.int32), np.arange(len(ids), dtype=np.int32),
                                     engine.model.new_cache(len(ids)))
    return ids, logits[-1]


# -- the random stream ----------------------------------------------------------------------------------------

def test_stream_is_splitmix64_from_the_seed():
    # Vigna's splitmix64.c seeded with 1234567: its first five outputs (the published reference sequence)
    assert [random_bits(1234567, p) for p in range(5)] == [
        6457827717110365317, 3203168211198807973, 9817491932198370423, 4593380528125082431, 16408922859458223821]


def test_uniform_is_a_pure_function_of_seed_and_position():
    forward = [uniform(7, p) for p in range(64)]
    backward = [uniform(7, p) for p in reversed(range(64))][::-1]
    assert forward == backward and all(0.0 <= u < 1.0 for u in forward)
    assert len(set(forward)) == 64 and uniform(8, 0) != uniform(7, 0)
    assert uniform(-1, 3) == uniform((1 << 64) - 1, 3)           # seeds are taken mod 2^64
    assert sample_seed(7, 0) == 7 and len({sample_seed(7, i) for i in range(100)}) == 100


# -- the distribution ------------------------------------------------------------------------------------------

def test_penalties_follow_vllm():
    logits = np.array([2.0, -1.0, 0.5, 3.0, -2.0], np.float32)
    counts = {1: 2, 2: 1}                          # output so far: token 1 twice, token 2 once
    prompt = [3]
    p = SamplingParams(temperature=1.0, repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    z = penalized_logits(logits, p, counts, prompt)
    # repetition: tokens in prompt or output; positive logits divided, negative multiplied; then f*count + q*seen
    assert z.tolist() == [2.0, -2.0 - 1.0 - 0.25, 0.25 - 0.5 - 0.25, 1.5, -2.0]


def test_top_k_and_top_p_keep_what_vllm_keeps():
    logits = np.log(np.array([0.05, 0.4, 0.1, 0.3, 0.15], np.float64)).astype(np.float32)
    ids, probs = distribution(logits, SamplingParams(temperature=1.0, top_k=3))
    assert ids.tolist() == [1, 3, 4] and probs == pytest.approx(np.array([0.4, 0.3, 0.15]) / 0.85)
    ids, _ = distribution(logits, SamplingParams(temperature=1.0, top_p=0.7))
    assert ids.tolist() == [1, 3]                  # 0.4 ahead of token 3 < 0.7; 0.7 ahead of token 4 is not
    ids, _ = distribution(logits, SamplingParams(temperature=1.0, top_p=0.71))
    assert ids.tolist() == [1, 3, 4]
    ids, _ = distribution(logits, SamplingParams(temperature=1.0, top_p=0.01))
    assert ids.tolist() == [1]                     # the most likely token always stays
    ids, probs = distribution(logits, SamplingParams(temperature=1.0, top_k=3, top_p=0.8))
    assert ids.tolist() == [1, 3]                  # top-p over the top-k renormalised: 0.47 + 0.35 ahead of 4
    tied = np.array([1.0, 2.0, 2.0, 0.0], np.float32)
    assert distribution(tied, SamplingParams(temperature=1.0, top_k=1))[0].tolist() == [1, 2]  # ties stay


@pytest.mark.parametrize("top_p", [0.05, 0.5, 0.9, 0.999])
def test_top_p_without_sorting_the_vocabulary_equals_a_full_sort(top_p):
    """The nucleus grows a top-M candidate set; a flat 20000-token distribution with ties needs many rounds."""
    rng = np.random.default_rng(3)
    logits = np.round(rng.standard_normal(20000) * 0.3, 2).astype(np.float32)   # many exactly equal values
    p = SamplingParams(temperature=1.0, top_p=top_p)
    w = np.exp(logits.astype(np.float64) - logits.max())
    order = np.argsort(-w, kind="stable")
    ahead = np.concatenate([[0.0], np.cumsum(w[order])[:-1]])
    want = np.sort(order[ahead < top_p * w.sum()])
    assert distribution(logits, p)[0].tolist() == want.tolist() and want.size > 64 * (top_p > 0.5)
    assert top_ids(logits.astype(np.float64), 300).tolist() == np.argsort(-logits, kind="stable")[:300].tolist()


def test_inverse_cdf_in_token_id_order():
    logits = np.log(np.array([0.25, 0.5, 0.25])).astype(np.float32)
    p = SamplingParams(temperature=1.0)
    assert [sample_token(logits, p, u) for u in (0.0, 0.2499, 0.2501, 0.7499, 0.7501, 0.9999)] == [0, 0, 1, 1, 2, 2]


def chi_square_critical(df: int, z: float = 3.090232) -> float:
    """Upper critical value of chi-square(df) at significance 0.001 (z = its normal quantile), Wilson-Hilferty."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def chi_square(counts: dict, ids: np.ndarray, probs: np.ndarray, n: int) -> tuple:
    """(statistic, df) of observed first-token counts against the expected n * probs (bins < 5 expected pooled)."""
    assert set(counts) <= set(ids.tolist()), f"drew tokens outside the kept set: {set(counts) - set(ids.tolist())}"
    obs = np.array([counts.get(int(i), 0) for i in ids], np.float64)
    exp = n * probs
    small = exp < 5
    obs = np.append(obs[~small], obs[small].sum())
    exp = np.append(exp[~small], exp[small].sum())
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    return float(((obs - exp) ** 2 / exp).sum()), len(exp) - 1


N_SEEDS = 6000


@pytest.mark.parametrize("T,top_k,top_p", [(1.0, 0, 1.0), (0.7, 0, 0.9), (1.5, 20, 1.0), (0.3, 8, 0.95)],
                         ids=["T1", "T0.7-p0.9", "T1.5-k20", "T0.3-k8-p0.95"])
def test_first_token_matches_the_target_distribution(prompt_logits, T, top_k, top_p):
    ids_prompt, row = prompt_logits
    params = SamplingParams(temperature=T, top_k=top_k, top_p=top_p)
    counts: dict = {}
    for seed in range(N_SEEDS):                    # deterministic seeds: the test cannot flake
        tok = Sampler(SamplingParams(temperature=T, top_k=top_k, top_p=top_p, seed=seed), ids_prompt).sample(row)
        counts[tok] = counts.get(tok, 0) + 1
    # the expected distribution computed directly: softmax(logits / T) restricted by top-k then top-p
    z = row.astype(np.float64) / T
    p = np.exp(z - z.max())
    if top_k:
        p[z < np.sort(z)[-top_k]] = 0
    p /= p.sum()
    order = np.argsort(-p, kind="stable")
    ahead = np.concatenate([[0], np.cumsum(p[order])[:-1]])
    p[order[ahead >= top_p]] = 0
    p /= p.sum()
    ids, probs = distribution(row, params)
    assert ids.tolist() == np.flatnonzero(p).tolist() and probs == pytest.approx(p[ids], rel=1e-9)
    stat, df = chi_square(counts, ids, probs, N_SEEDS)
    assert df >= 2 and stat < chi_square_critical(df), (stat, df)


def test_chi_square_rejects_a_wrong_temperature(prompt_logits):
    """The statistic above can fail: T=1 draws tested against the T=0.7 distribution are rejected."""
    ids_prompt, row = prompt_logits
    counts: dict = {}
    for seed in range(N_SEEDS):
        tok = Sampler(SamplingParams(temperature=1.0, seed=seed), ids_prompt).sample(row)
        counts[tok] = counts.get(tok, 0) + 1
    ids, probs = distribution(row, SamplingParams(temperature=0.7))
    counts = {k: v for k, v in counts.items() if k in set(ids.tolist())}
    stat, df = chi_square(counts, ids, probs, sum(counts.values()))
    assert stat > chi_square_critical(df)


def test_the_loop_draws_the_first_token_with_position_zero(engine, prompt_logits):
    ids_prompt, row = prompt_logits
    for seed in range(5):
        p = SamplingParams(temperature=1.0, seed=seed)
        r = generate(engine.model, None, AR, ids_prompt, 1, sampling=p)
        assert r.tokens == [sample_token(row, p, uniform(seed, 0))] and r.seed == seed


@pytest.mark.parametrize("kind", ["ar", "ddtree"])
def test_temperature_to_zero_is_greedy(engine, kind):
    ids = engine.tokenizer.encode("import os\n")
    tree = AR if kind == "ar" else engine.cfg.tree
    drafter = engine.drafter if kind != "ar" else None
    greedy = generate(engine.model, drafter, tree, ids, 24)
    assert greedy.seed is None
    for seed in range(3):
        cold = generate(engine.model, drafter, tree, ids, 24, sampling=SamplingParams(temperature=1e-4, seed=seed))
        assert cold.tokens == greedy.tokens and cold.seed == seed
    hot = [generate(engine.model, drafter, tree, ids, 24, sampling=SamplingParams(temperature=1.5, seed=s)).tokens
           for s in range(3)]
    assert any(h != greedy.tokens for h in hot)   # and a real temperature does sample


def test_no_seed_draws_one_and_reports_it(engine):
    ids = engine.tokenizer.encode("x = ")
    r = generate(engine.model, engine.drafter, engine.cfg.tree, ids, 12, sampling=SamplingParams(temperature=1.0))
    assert isinstance(r.seed, int) and 0 <= r.seed < 2 ** 53
    again = generate(engine.model, None, AR, ids, 12, sampling=SamplingParams(temperature=1.0, seed=r.seed))
    assert again.tokens == r.tokens               # the reported seed replays the run (here through AR)


# -- logprobs and echo -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind,T", [("ar", 0.0), ("ddtree", 0.0), ("ddtree", 0.8), ("chain", 1.2)])
def test_logprobs_equal_a_reference_forward_and_sum_with_echo(engine, kind, T):
    ids = engine.tokenizer.encode("class Stack:\n    def ")
    tree = AR if kind == "ar" else OmegaConf.merge(engine.cfg.tree, {"kind": kind, "width": 1} if kind == "chain"
                                                    else {})
    p = SamplingParams(temperature=T, seed=3, logprobs=4, echo=True)
    r = generate(engine.model, None if kind == "ar" else engine.drafter, tree, ids, 20, sampling=p)
    seq = ids + r.tokens
    ref, _ = engine.model.forward(np.asarray(seq, np.int32), np.arange(len(seq), dtype=np.int32),
                                  engine.model.new_cache(len(seq)))
    ref_lp = log_softmax(ref)                                      # f64[len(seq), V]
    P = len(ids)
    assert len(r.logprobs) == len(r.tokens) == 20 and len(r.prompt_logprobs) == P and r.prompt_logprobs[0] is None
    for i, (tok, lp) in enumerate(zip(r.tokens, r.logprobs)):
        row = ref_lp[P - 1 + i]
        assert lp["token"] == tok and lp["logprob"] == pytest.approx(row[tok], abs=1e-4)
        assert [t for t, _ in lp["top"]] == np.argsort(-row, kind="stable")[:4].tolist()
        assert [v for _, v in lp["top"]] == pytest.approx(np.sort(row)[::-1][:4], abs=1e-4)
    for j in range(1, P):
        assert r.prompt_logprobs[j]["token"] == ids[j]
        assert r.prompt_logprobs[j]["logprob"] == pytest.approx(ref_lp[j - 1, ids[j]], abs=1e-4)
    total = sum(e["logprob"] for e in r.prompt_logprobs[1:]) + sum(e["logprob"] for e in r.logprobs)
    assert total == pytest.approx(sum(ref_lp[k - 1, seq[k]] for k in range(1, len(seq))), abs=1e-3)
    if T == 0.0:                                                    # greedy: every token is its row's best
        assert all(lp["top"][0][0] == lp["token"] for lp in r.logprobs)


@pytest.mark.parametrize("kind", ["ar", "ddtree"])
def test_echo_with_no_new_tokens_scores_the_prompt(engine, kind):
    ids = engine.tokenizer.encode("import sys")
    tree = AR if kind == "ar" else engine.cfg.tree
    r = generate(engine.model, engine.drafter, tree, ids, 0, sampling=SamplingParams(temperature=0, logprobs=2,
                                                                                     echo=True))
    full = generate(engine.model, engine.drafter, tree, ids, 3, sampling=SamplingParams(temperature=0, logprobs=2,
                                                                                        echo=True))
    assert r.tokens == [] and r.target_forwards == 1 and r.prompt_logprobs == full.prompt_logprobs
    assert len(r.prompt_logprobs) == len(ids)


def test_no_logprobs_unless_asked(engine):
    r = generate(engine.model, engine.drafter, engine.cfg.tree, [65, 66], 4, sampling=SamplingParams(seed=1))
    assert r.logprobs is None and r.prompt_logprobs is None
    r = generate(engine.model, engine.drafter, engine.cfg.tree, [65, 66], 4,
                 sampling=SamplingParams(seed=1, logprobs=0, echo=False))
    assert [lp["top"] for lp in r.logprobs] == [[]] * 4 and r.prompt_logprobs is None


# -- n samples sharing one prefill ---------------------------------------------------------------------------

class CountingModel:
    """The real model, counting the rows of each forward (to see that the prompt is forwarded once)."""

    def __init__(self, model):
        self.model, self.rows = model, []

    def __getattr__(self, name):
        return getattr(self.model, name)

    def forward(self, tokens, *args, **kw):
        self.rows.append(len(tokens))
        return self.model.forward(tokens, *args, **kw)

    def forward_batch(self, seqs, *args, **kw):        # the decoder's one forward (each sequence's rows counted)
        self.rows.extend(len(s[0]) for s in seqs)
        return self.model.forward_batch(seqs, *args, **kw)


@pytest.mark.parametrize("kind", ["ar", "ddtree"])
def test_n_samples_share_the_prefill_and_equal_single_runs(engine, kind):
    ids = engine.tokenizer.encode("for i in range(")
    tree = AR if kind == "ar" else engine.cfg.tree
    drafter = None if kind == "ar" else engine.drafter
    model = CountingModel(engine.model)
    p = SamplingParams(temperature=1.0, seed=11, n=3, logprobs=1, echo=True)
    results = generate_n(model, drafter, tree, ids, 16, p)
    assert model.rows.count(len(ids)) == 1                # the prompt was forwarded once for the 3 samples
    assert [r.seed for r in results] == [11, sample_seed(11, 1), sample_seed(11, 2)]
    assert len({tuple(r.tokens) for r in results}) > 1   # independent samples
    for i, r in enumerate(results):
        alone = generate(engine.model, drafter, tree, ids, 16, sampling=SamplingParams(
            temperature=1.0, seed=r.seed, logprobs=1, echo=True))
        assert r.tokens == alone.tokens and r.logprobs == alone.logprobs
        assert r.prompt_logprobs == alone.prompt_logprobs
        assert r.target_forwards == alone.target_forwards - (i > 0)   # samples after the first skip the prefill


def test_n_streams_each_sample(engine):
    got: dict = {}
    results = generate_n(engine.model, engine.drafter, engine.cfg.tree, [72, 105], 10,
                         SamplingParams(temperature=0.9, seed=5, n=2),
                         on_tokens=lambda i, new: got.setdefault(i, []).extend(new))
    assert [got[i] for i in range(2)] == [r.tokens for r in results]


def test_engine_generate_and_generate_n(engine):
    ids = engine.tokenizer.encode("if x")
    r = engine.generate(ids, 8, sampling=SamplingParams(temperature=0.8, seed=2, logprobs=2))
    assert r.seed == 2 and len(r.logprobs) == len(r.tokens) and r.finish_reason in ("length", "eos")
    assert engine.generate(ids, 8).seed is None                     # no sampling: greedy, as before
    with pytest.raises(Exception, match="use Engine.generate_n"):
        engine.generate(ids, 8, sampling=SamplingParams(temperature=0.8, n=2))
    rs = engine.generate_n(ids, 8, SamplingParams(temperature=0.8, seed=2, n=2))
    assert rs[0].tokens == engine.generate(ids, 8, sampling=SamplingParams(temperature=0.8, seed=2)).tokens


# -- SamplingParams: the front end's API ---------------------------------------------------------------------

@pytest.mark.parametrize("field,value,needle", [
    ("temperature", -0.1, "temperature=-0.1 must be >= 0"),
    ("temperature", "hot", "temperature must be a finite number; got 'hot'"),
    ("temperature", float("nan"), "temperature must be a finite number"),
    ("top_p", 0.0, "top_p=0.0 must be in (0, 1]"),
    ("top_p", 1.5, "top_p=1.5 must be in (0, 1]"),
    ("top_k", -2, "top_k=-2 must be -1 or 0"),
    ("top_k", 2.5, "top_k must be an integer; got 2.5"),
    ("presence_penalty", 2.5, "presence_penalty=2.5 must be in [-2, 2]"),
    ("frequency_penalty", -3, "frequency_penalty=-3.0 must be in [-2, 2]"),
    ("repetition_penalty", 0, "repetition_penalty=0.0 must be in (0, 2]"),
    ("seed", "7", "seed must be an integer; got '7'"),
    ("logprobs", 21, "logprobs=21 must be in 0..20"),
    ("n", 0, "n=0 must be in 1..128"),
    ("echo", "yes", "echo must be true or false"),
])
def test_bad_values_are_one_line_naming_the_field(field, value, needle):
    with pytest.raises(SamplingError) as e:
        SamplingParams(**{field: value})
    assert e.value.param == field and needle in str(e.value) and "\n" not in str(e.value)


def test_greedy_n_is_refused():
    with pytest.raises(SamplingError, match="n=2 with temperature=0") as e:
        SamplingParams(temperature=0, n=2)
    assert e.value.param == "n"


def test_from_openai_completions_and_chat():
    d = {"temperature": 1.0, "top_p": 1.0}
    p = SamplingParams.from_openai({"temperature": 0.5, "top_p": 0.9, "seed": 3, "logprobs": 2, "echo": True,
                                    "n": 2, "best_of": 2, "presence_penalty": 0.1}, defaults=d)
    assert (p.temperature, p.top_p, p.seed, p.logprobs, p.echo, p.n, p.presence_penalty) == \
        (0.5, 0.9, 3, 2, True, 2, 0.1)
    assert SamplingParams.from_openai({}, defaults=d).temperature == 1.0    # OpenAI's default, not greedy
    assert SamplingParams.from_openai({"temperature": None}, defaults={"temperature": 0.6}).temperature == 0.6
    assert SamplingParams.from_openai({"temperature": 0}).greedy                 # the operator's probe
    c = SamplingParams.from_openai({"logprobs": True, "top_logprobs": 5}, chat=True)
    assert c.logprobs == 5
    assert SamplingParams.from_openai({"logprobs": True}, chat=True).logprobs == 0
    assert SamplingParams.from_openai({"logprobs": False, "echo": True}, chat=True).logprobs is None
    for body, chat, param in (({"top_logprobs": 2}, True, "top_logprobs"), ({"logprobs": 3}, True, "logprobs"),
                              ({"logprobs": True}, False, "logprobs"), ({"n": 2, "best_of": 3}, False, "best_of"),
                              ({"top_k": "x"}, False, "top_k"),
                              ({"logprobs": True, "top_logprobs": 25}, True, "top_logprobs")):
        with pytest.raises(SamplingError) as e:
            SamplingParams.from_openai(body, chat=chat)
        assert e.value.param == param


def test_resolved_and_for_sample():
    p = SamplingParams(temperature=1.0)
    r = p.resolved()
    assert p.seed is None and isinstance(r.seed, int) and r.resolved() is r
    s = SamplingParams(temperature=1.0, seed=9, n=4)
    assert [s.for_sample(i).seed for i in range(2)] == [9, sample_seed(9, 1)] and s.for_sample(1).n == 1
