"""Sampling that stays lossless: a counter-based random stream and the target's processed distribution.

Random stream. The uniform number used at output position p (0 = the first generated token) of a request is

    uniform(seed, p) = (mix64(seed + (p + 1) * 0x9E3779B97F4A7C15 mod 2^64) >> 11) * 2^-53      in [0, 1), 53 bits

i.e. the (p+1)-th output of splitmix64 (Steele, Lea & Flood 2014; Vigna's splitmix64.c) started from `seed`. It
is a pure function of (seed, p): it never depends on how many numbers were drawn before, on the batch or on
the tree, so AR (one position per forward) and DDTree (many positions per verify) use the same number for
the same output position. Sample i of n uses sample_seed(seed, i) (i = 0: the request's seed itself).

Distribution (vLLM's documented order: penalties on the raw logits, then temperature, then top-k, then top-p):
    repetition_penalty r: tokens in the prompt or the output so far: logit > 0 -> logit / r, else logit * r
    frequency_penalty f, presence_penalty q: logit -= f * count_in_output + q * (count_in_output > 0)
    z = logits / temperature (float64)
    top_k k > 0: keep tokens with z >= the k-th largest z (ties at the boundary are kept, as vLLM's mask does)
    top_p p < 1: keep a token iff the mass of the more probable tokens (equal probabilities: lower ids first)
                 is < p (vLLM drops the ascending-cumsum prefix <= 1 - p; the most likely token is always kept)
The sample is the inverse CDF in ascending token id order (fixed, and needs no sort): the first kept token
whose cumulative weight exceeds u * (kept total weight). Temperature 0 (below 1e-5) draws nothing: the decoder
takes the argmax, of the penalised logits when penalties are set (vLLM's order: penalties, then the argmax). Logprobs are the raw target distribution's (log-softmax of the logits).

    params = SamplingParams(temperature=0.8, top_p=0.95, seed=7).resolved()
    s = Sampler(params, prompt_ids)              # per request (per sample of n)
    tok = s.sample(logits_row)                   # uses uniform(seed, s.position), then commits tok
"""
from __future__ import annotations

import math
import secrets
from dataclasses import dataclass, fields, replace
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from kdtree.errors import ConfigError

MASK64 = (1 << 64) - 1
GAMMA = 0x9E3779B97F4A7C15          # splitmix64's increment (2^64 / golden ratio, odd)
MAX_LOGPROBS = 20                   # top logprobs per position (OpenAI chat's top_logprobs bound; vLLM's default)
MAX_N = 128                         # samples per request
GREEDY_BELOW = 1e-5                 # temperatures below this decode greedily (vLLM's _SAMPLING_EPS): z / T overflows
SEED_BITS = 53                      # random seeds fit a JSON number any client reads exactly (2^53)


class SamplingError(ConfigError):
    """A bad sampling field: `param` names it (the HTTP front end answers 400 with param=field)."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


def mix64(z: int) -> int:
    """splitmix64's output function on a 64-bit integer."""
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return z ^ (z >> 31)


def random_bits(seed: int, position: int) -> int:
    """The (position+1)-th 64-bit output of splitmix64 seeded with `seed` (any int, taken mod 2^64)."""
    return mix64((int(seed) + (int(position) + 1) * GAMMA) & MASK64)


def uniform(seed: int, position: int) -> float:
    """Uniform float64 in [0, 1) with 53 random bits for output position `position` of the stream `seed`."""
    return (random_bits(seed, position) >> 11) * (1.0 / (1 << 53))


def sample_seed(seed: int, index: int) -> int:
    """Seed of sample `index` of n: the request's seed for index 0, a splitmix64-mixed one after."""
    return int(seed) if index == 0 else mix64((int(seed) & MASK64) ^ mix64(int(index) * GAMMA & MASK64))


def random_seed() -> int:
    return secrets.randbits(SEED_BITS)


def _number(name: str, v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(float(v)):
        raise SamplingError(name, f"{name} must be a finite number; got {v!r}")
    return float(v)


def _integer(name: str, v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        if isinstance(v, float) and v.is_integer():
            return int(v)
        raise SamplingError(name, f"{name} must be an integer; got {v!r}")
    return int(v)


@dataclass(frozen=True)
class SamplingParams:
    """One request's sampling. temperature 0 = greedy: the argmax (of the penalised logits when a penalty is set;
    top_p, top_k and seed are then ignored). Bounds are vLLM's/OpenAI's; validate() says which field is wrong."""
    temperature: float = 1.0            # >= 0; 0 (anything < 1e-5) = greedy argmax
    top_p: float = 1.0                  # (0, 1]; 1 = all tokens
    top_k: int = 0                      # 0 or -1 = all tokens, else >= 1
    seed: Optional[int] = None          # None = a random one, drawn by resolved() and reported back
    presence_penalty: float = 0.0       # [-2, 2]
    frequency_penalty: float = 0.0      # [-2, 2]
    repetition_penalty: float = 1.0     # (0, 2]; 1 = off
    logprobs: Optional[int] = None      # top logprobs per emitted token, 0..20 (0 = only the chosen token's)
    echo: bool = False                  # with logprobs: also the prompt's logprobs (from the prefill)
    n: int = 1                          # independent samples of the prompt, 1..128

    def __post_init__(self):
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @property
    def penalized(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    def validate(self) -> None:
        """One SamplingError line per bad value, naming the field, the value and the valid range."""
        t = _number("temperature", self.temperature)
        if t < 0:
            raise SamplingError("temperature", f"temperature={t} must be >= 0 (0 = greedy); use e.g. 0.7")
        p = _number("top_p", self.top_p)
        if not 0.0 < p <= 1.0:
            raise SamplingError("top_p", f"top_p={p} must be in (0, 1] (1 = all tokens); use e.g. 0.95")
        k = _integer("top_k", self.top_k)
        if k < -1:
            raise SamplingError("top_k", f"top_k={k} must be -1 or 0 (all tokens) or >= 1")
        for name, lo in (("presence_penalty", -2.0), ("frequency_penalty", -2.0)):
            v = _number(name, getattr(self, name))
            if not lo <= v <= 2.0:
                raise SamplingError(name, f"{name}={v} must be in [-2, 2] (0 = off)")
        r = _number("repetition_penalty", self.repetition_penalty)
        if not 0.0 < r <= 2.0:
            raise SamplingError("repetition_penalty", f"repetition_penalty={r} must be in (0, 2] (1 = off)")
        if self.seed is not None:
            _integer("seed", self.seed)
        if self.logprobs is not None:
            lp = _integer("logprobs", self.logprobs)
            if not 0 <= lp <= MAX_LOGPROBS:
                raise SamplingError("logprobs", f"logprobs={lp} must be in 0..{MAX_LOGPROBS} (top logprobs per "
                                                f"token; 0 = only the chosen token's)")
        if not isinstance(self.echo, bool):
            raise SamplingError("echo", f"echo must be true or false; got {self.echo!r}")
        n = _integer("n", self.n)
        if not 1 <= n <= MAX_N:
            raise SamplingError("n", f"n={n} must be in 1..{MAX_N}")
        if n > 1 and t < GREEDY_BELOW:
            raise SamplingError("n", f"n={n} with temperature=0: greedy decoding has one answer; use n=1 or "
                                     f"temperature > 0")

    def resolved(self) -> "SamplingParams":
        """These params with a seed: the given one, else a random one (reported back so the run replays)."""
        return self if self.seed is not None else replace(self, seed=random_seed())

    def for_sample(self, index: int) -> "SamplingParams":
        """Params of sample `index` of n: n=1 and a seed derived from this (resolved) seed."""
        base = self.resolved()
        return replace(base, n=1, seed=sample_seed(base.seed, index))

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def merged(cls, *layers: Optional[Mapping[str, Any]], **base: Any) -> "SamplingParams":
        """Later layers override earlier ones; None values mean "not set" and do not override."""
        values: Dict[str, Any] = dict(base)
        known = {f.name for f in fields(cls)}
        for layer in layers:
            for k, v in (layer or {}).items():
                if k in known and v is not None:
                    values[k] = v
        return cls(**values)

    @classmethod
    def from_openai(cls, body: Mapping[str, Any], defaults: Optional[Mapping[str, Any]] = None,
                    chat: bool = False) -> "SamplingParams":
        """OpenAI request fields -> params. Omitted fields come from `defaults` (engine.sampling_defaults():
        the operator's sampling config, the checkpoint's generation_config.json, OpenAI's temperature 1).
        completions: logprobs = int (top count), echo; chat: logprobs = bool + top_logprobs = int.
        top_k, repetition_penalty are vLLM's extensions. best_of must be absent or equal n."""
        fields_: Dict[str, Any] = {}
        for k in ("temperature", "top_p", "top_k", "seed", "presence_penalty", "frequency_penalty",
                  "repetition_penalty", "n"):
            if body.get(k) is not None:
                fields_[k] = body[k]
        if chat:
            lp = body.get("logprobs")
            if lp is not None and not isinstance(lp, bool):
                raise SamplingError("logprobs", f"logprobs must be true or false in chat completions; got {lp!r} "
                                                f"(use top_logprobs=N for the top N)")
            top = body.get("top_logprobs")
            if top is not None and not lp:
                raise SamplingError("top_logprobs", f"top_logprobs={top!r} needs logprobs=true")
            if top is not None and (isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= MAX_LOGPROBS):
                raise SamplingError("top_logprobs", f"top_logprobs={top!r} must be an integer in 0..{MAX_LOGPROBS}")
            if lp:
                fields_["logprobs"] = top if top is not None else 0
        else:
            lp = body.get("logprobs")
            if lp is not None and lp is not False:
                if lp is True:
                    raise SamplingError("logprobs", f"logprobs must be an integer 0..{MAX_LOGPROBS} in completions; "
                                                    f"got true")
                fields_["logprobs"] = lp
            if body.get("echo") is not None:
                fields_["echo"] = body["echo"]
        best_of = body.get("best_of")
        if best_of is not None and best_of != fields_.get("n", 1):
            raise SamplingError("best_of", f"best_of={best_of!r} is not supported unless it equals n; omit it")
        return cls.merged(defaults, fields_)


# -- the distribution --------------------------------------------------------------------------------------

def penalized_logits(logits: np.ndarray, params: SamplingParams, output_counts: Optional[Mapping[int, int]] = None,
                     prompt_ids: Optional[Sequence[int]] = None) -> np.ndarray:
    """f32[V] raw logits -> f64[V] after vLLM's repetition / frequency / presence penalties.
    output_counts {token: occurrences in the output so far}; prompt_ids: the prompt's tokens. Touches only the
    seen tokens (O(seen), not O(V))."""
    z = np.array(logits, np.float64)
    if not params.penalized:
        return z
    counts = output_counts or {}
    if params.repetition_penalty != 1.0:
        seen = np.fromiter(set(counts) | set(int(t) for t in (prompt_ids or ())), np.int64)
        v = z[seen]
        z[seen] = np.where(v > 0, v / params.repetition_penalty, v * params.repetition_penalty)
    if counts:
        ids = np.fromiter(counts.keys(), np.int64, len(counts))
        n = np.fromiter(counts.values(), np.float64, len(counts))
        z[ids] -= params.frequency_penalty * n + params.presence_penalty
    return z


def _top_p(w: np.ndarray, p: float) -> np.ndarray:
    """Zero the weights outside the nucleus: keep a token iff the weight of the tokens ahead of it (weight
    descending, ties by id) is < p * total. Sorts only a growing top-M candidate set, never the vocabulary,
    with the same result as a full sort (candidates are every token >= the M-th weight, ties included)."""
    total = w.sum()
    nonzero = int(np.count_nonzero(w))
    m = 64
    while True:
        if m >= nonzero:
            cand = np.flatnonzero(w)
        else:
            cand = np.flatnonzero(w >= np.partition(w, w.size - m)[w.size - m])
        order = cand[np.argsort(-w[cand], kind="stable")]       # weight descending, equal weights by id
        csum = np.cumsum(w[order])
        if csum[-1] >= p * total or cand.size >= nonzero:
            ahead = np.concatenate([[0.0], csum[:-1]])
            out = np.zeros_like(w)
            keep = order[ahead < p * total]                       # the heaviest token has 0 ahead: always kept
            out[keep] = w[keep]
            return out
        m *= 4


def weights(logits: np.ndarray, params: SamplingParams, output_counts: Optional[Mapping[int, int]] = None,
            prompt_ids: Optional[Sequence[int]] = None) -> np.ndarray:
    """f64[V] unnormalised probabilities of the sampling distribution, 0 for tokens top-k/top-p dropped.
    Penalties, then temperature, then top-k, then top-p."""
    if params.greedy:
        raise ValueError("temperature 0: greedy decoding takes the argmax, it does not sample")
    z = penalized_logits(logits, params, output_counts, prompt_ids)
    z /= params.temperature
    w = np.exp(z - z.max())                                       # the max is 1: no overflow, never dropped
    V = w.size
    if 0 < params.top_k < V:
        w[z < np.partition(z, V - params.top_k)[V - params.top_k]] = 0.0   # ties with the k-th value stay
    if params.top_p < 1.0:
        w = _top_p(w, params.top_p)
    return w


def distribution(logits: np.ndarray, params: SamplingParams, output_counts: Optional[Mapping[int, int]] = None,
                 prompt_ids: Optional[Sequence[int]] = None) -> Tuple[np.ndarray, np.ndarray]:
    """(ids i64[K] ascending, probs f64[K]) of the kept tokens; probs sum to 1."""
    w = weights(logits, params, output_counts, prompt_ids)
    ids = np.flatnonzero(w)
    return ids, w[ids] / w[ids].sum()


def sample_token(logits: np.ndarray, params: SamplingParams, u: float,
                 output_counts: Optional[Mapping[int, int]] = None, prompt_ids: Optional[Sequence[int]] = None) -> int:
    """Inverse CDF at u in [0, 1) in token id order: the first token whose cumulative weight exceeds u * total
    (dropped tokens weigh 0 and are never chosen). A pure function of (logits, params, history, u)."""
    cdf = np.cumsum(weights(logits, params, output_counts, prompt_ids))
    return int(min(np.searchsorted(cdf, u * cdf[-1], side="right"), cdf.size - 1))


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """f32[..., V] -> f64 log-probabilities of the target's raw distribution (before any sampling transform)."""
    z = np.asarray(logits, np.float64)
    z = z - z.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


def top_ids(z: np.ndarray, k: int) -> np.ndarray:
    """i64[k] indices of the k largest values, descending, equal values by ascending index (no full sort)."""
    if k >= z.size:
        return np.argsort(-z, kind="stable")
    cand = np.flatnonzero(z >= np.partition(z, z.size - k)[z.size - k])
    return cand[np.argsort(-z[cand], kind="stable")][:k]


def token_logprob(logits_row: np.ndarray, token: int, top: int) -> dict:
    """{"token", "logprob", "top": [[id, logprob], ...]} of one position from the raw distribution
    log_softmax(logits); top = the `top` most likely tokens, equal values by id."""
    z = np.asarray(logits_row, np.float64)
    m = z.max()
    lse = m + np.log(np.exp(z - m).sum())                        # f64 log-sum-exp: one pass over V
    out = {"token": int(token), "logprob": float(z[token] - lse), "top": []}
    if top > 0:
        out["top"] = [[int(i), float(z[i] - lse)] for i in top_ids(z, top)]
    return out


def prompt_logprobs(prompt: Sequence[int], logits: np.ndarray, top: int) -> List[Optional[dict]]:
    """Logprobs of prompt tokens 1..P-1 from the prefill's rows 0..P-2 (token 0 has none: None)."""
    return [None] + [token_logprob(logits[i], int(prompt[i + 1]), top) for i in range(len(prompt) - 1)]


class Sampler:
    """One sample's state: params (resolved seed), the prompt and output counts for the penalties, and the
    output position. sample(row) draws with uniform(seed, position) and commits the token; at temperature 0
    (penalties set) it takes the penalised argmax instead, as deterministic and as lossless under speculation."""

    def __init__(self, params: SamplingParams, prompt: Sequence[int]):
        if params.seed is None and not params.greedy:
            raise ValueError("Sampler needs resolved params (params.resolved()) so the seed can be reported")
        self.params, self.position = params, 0
        self.seed = None if params.greedy else int(params.seed)
        self.prompt = sorted(set(int(t) for t in prompt)) if params.penalized else ()
        self.counts: Dict[int, int] = {}

    def peek(self, logits_row: np.ndarray) -> int:
        """The token this position would draw, without committing it. Greedy (temperature 0) with penalties: the
        argmax of the penalised logits (vLLM applies penalties before its greedy argmax; ties -> lowest id)."""
        if self.seed is None:
            return int(np.argmax(penalized_logits(logits_row, self.params, self.counts, self.prompt)))
        return sample_token(logits_row, self.params, uniform(self.seed, self.position), self.counts, self.prompt)

    def commit(self, token: int) -> None:
        if self.params.penalized:
            self.counts[int(token)] = self.counts.get(int(token), 0) + 1
        self.position += 1

    def sample(self, logits_row: np.ndarray) -> int:
        tok = self.peek(logits_row)
        self.commit(tok)
        return tok


def sampled_walk(parents: np.ndarray, tokens: np.ndarray, draw: Callable[[int], int]) -> Tuple[np.ndarray, int]:
    """The sampling accept walk: from the root (row 0) draw the target's token at the current row
    (draw(row) samples and commits), follow the first child (node order) whose token equals it, stop at the
    first draw no child matches; that draw is the bonus. Returns (path i32[k] node indices, bonus); only the
    k + 1 visited rows are ever sampled. Greedy decoding keeps ops.tree_accept (the same rule with argmax)."""
    parents = np.asarray(parents, np.int32)
    tokens = np.asarray(tokens, np.int32)
    path: List[int] = []
    cur = -1
    while True:
        want = draw(cur + 1)
        nxt = next((i for i in range(cur + 1, len(parents)) if parents[i] == cur and tokens[i] == want), None)
        if nxt is None:
            return np.array(path, np.int32), int(want)
        path.append(nxt)
        cur = nxt


__all__ = ["SamplingParams", "SamplingError", "Sampler", "uniform", "random_bits", "sample_seed", "mix64",
           "weights", "distribution", "sample_token", "log_softmax", "top_ids", "token_logprob", "prompt_logprobs",
           "sampled_walk"]
