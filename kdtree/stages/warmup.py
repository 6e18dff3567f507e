"""warmup: run every decode shape once before the port says ready, so the first user request does not pay
for first-touch allocations, lazy imports or (backend=cuda) kernel selection; seconds per shape land in
status.json (`warmup_seconds`) and events.jsonl.

Every shape runs through what the server runs: engine.generate and engine.submit go through the engine's own
scheduler (kdtree/decode/scheduler.py: DecodeState rounds, one forward_batch per step), the bare verify sizes through
the same forward_batch. Shapes: prefill at a few prompt lengths; one target forward over every verify block size
1..tree.budget+1 (root + nodes, on a short cached prefix, rolled back with truncate); one short generation
(drafter + tree build + accept, or the AR step); and one batched step of several requests decoded together. backend=cuda with
the native forward: the AR step (1 row) and the verify block (tree.budget + 1 rows) are the CUDA-graph buckets
(engine.graph_rows), captured by those shapes' first forwards and replayed after; warm-up reports how many graphs
and the capture seconds. Other row counts (prefill chunks, batched steps) launch eagerly. The numpy/cpu backends
have nothing to capture. Before the shapes: tree.policy=cost's forward-cost curve and the grammar compiler's
vocabulary (`cost_curve`, `grammar_vocab` in warmup_seconds), which the first such request would otherwise build.
"""
from __future__ import annotations

import time
from typing import List, Tuple

import numpy as np

from kdtree.decode.cost import ForwardCosts, policy_of
from kdtree.decode.request import Request
from kdtree.engine import EngineState
from kdtree.errors import PipelineError
from kdtree.serve.status import make_status  # noqa: F401  (declared: the engine process's status.json)

SIDE = "host"
PREFILL_LENGTHS = (1, 16, 128)     # tokens; capped by the context
BATCH = 4                          # requests of the batched shape (the server's multi-request step)


def warmup_shapes(cfg, engine) -> List[Tuple[str, int, int]]:
    """(name, tokens, new tokens) per shape; new tokens = 0 marks a bare verify forward of `tokens` rows."""
    has_tree = getattr(engine, "drafter", None) is not None and cfg.tree.kind != "ar"
    budget = int(cfg.tree.budget) if has_tree else 0
    room = int(engine.max_context) - budget - 2 - 8
    shapes = [(f"prefill_{n}", n, 1) for n in PREFILL_LENGTHS if n <= room]
    # bare forwards drive the model directly: only where one process holds the whole model (tp=1)
    if int(cfg.tp.size) == 1 and hasattr(getattr(engine, "model", None), "new_cache"):
        shapes += [(f"verify_{t}", t, 0) for t in range(1, budget + 2)]      # root + 0..budget nodes
    if has_tree:
        shapes.append((f"decode_tree_{budget}", 4, int(cfg.tree.depth) + 2))  # at least one full round
    else:
        shapes.append(("decode_1", 4, 4))
    shapes.append((f"batch_{BATCH}", 4, int(cfg.tree.depth) + 2 if has_tree else 4))   # BATCH requests together
    return shapes


class _VerifyBlock:
    """Target forwards of `rows` tokens after a cached prefix (the verify block's shape), rolled back each time."""

    def __init__(self, engine, prefix: List[int]):
        self.model, self.n = engine.model, len(prefix)
        self.prefix = prefix
        self.cache = self.model.new_cache(self.n + int(engine.cfg.tree.budget) + 2)
        self.model.forward_batch([(np.asarray(prefix, np.int32), np.arange(self.n, dtype=np.int32), self.cache, None)])

    def __call__(self, rows: int) -> None:
        toks = np.asarray((self.prefix * (rows // self.n + 1))[:rows], np.int32)   # tokens [rows]
        self.model.forward_batch([(toks, np.arange(self.n, self.n + rows, dtype=np.int32), self.cache, None)])
        self.cache.truncate(self.n)

    def close(self) -> None:
        if hasattr(self.cache, "release"):
            self.cache.release()       # back to the pool the server's requests are carved from


def _batched(engine, prompt: List[int], n_new: int) -> None:
    """BATCH requests submitted together and decoded in the same steps (the server's batched forward)."""
    reqs = [engine.submit(Request(prompt[i:] + prompt[:i], n_new)) for i in range(BATCH)]
    for req in reqs:
        engine.drive(req)


def _serving_tables(ctx, engine, has_tree: bool) -> dict:
    """What a server's first requests would otherwise build while a client waits: tree.policy=cost's forward-cost
    curve (one forward per verify size, kdtree/decode/cost.py) and the grammar compiler's vocabulary (llguidance's
    token trie: ~8 s at K2.6's 163840 tokens), so the first structured or cost-policy request is as fast as the
    rest. Seconds by name."""
    out = {}
    if has_tree and policy_of(ctx.cfg.tree) == "cost" and hasattr(getattr(engine, "model", None), "new_cache"):
        sched = engine.scheduler
        if ctx.status is not None:
            ctx.status.update(warmup_shape="cost_curve")
        t0 = time.perf_counter()
        if sched.costs is None:
            sched.costs = ForwardCosts(engine.model)
        if sched.costs.calibrated or sched.costs.calibrate(int(ctx.cfg.tree.budget) + 1):
            out["cost_curve"] = round(time.perf_counter() - t0, 4)
    if ctx.status is not None:
        ctx.status.update(warmup_shape="grammar_vocab")
    t0 = time.perf_counter()
    try:
        engine.grammars()
    except Exception as e:                           # a tokenizer llguidance cannot take: structured requests say so
        ctx.emit("warmup_grammar", error=f"{type(e).__name__}: {e}")
    else:
        out["grammar_vocab"] = round(time.perf_counter() - t0, 4)
    for name, s in out.items():
        ctx.emit("warmup_shape", shape=name, prompt_tokens=0, new_tokens=0, seconds=s)
    return out


def run(ctx) -> dict:
    engine = EngineState.of(ctx).engine
    if engine is None:
        raise PipelineError("stage warmup: no engine in this process; put `{stage: load, on: host}` before warmup")
    engine.scheduler                               # the server's scheduler (and its cache pool) from the start
    shapes = warmup_shapes(ctx.cfg, engine)
    has_tree = getattr(engine, "drafter", None) is not None and ctx.cfg.tree.kind != "ar"
    buckets = sorted({1, int(ctx.cfg.tree.budget) + 1 if has_tree else 1})
    capture = engine.graph_rows(buckets)           # backend=cuda with the native forward; False elsewhere
    base = list(engine.tokenizer.encode("The quick brown fox jumps over the lazy dog. ")) or [0]
    seconds = {}
    verify = None
    if ctx.status is not None:
        ctx.status.update(phase="warmup", warmup_total=len(shapes), warmup_done=0, warmup_seconds={})
    t_all = time.perf_counter()
    seconds.update(_serving_tables(ctx, engine, has_tree))
    for i, (name, n_tokens, n_new) in enumerate(shapes):
        if ctx.status is not None:
            ctx.status.update(warmup_shape=name)
        if not n_new and verify is None:
            verify = _VerifyBlock(engine, base[:8])
        t0 = time.perf_counter()
        prompt = (base * (n_tokens // len(base) + 1))[:n_tokens]
        if name.startswith("batch_"):
            _batched(engine, prompt, n_new)
        elif n_new:
            engine.generate(prompt, n_new)
        else:
            verify(n_tokens)
        seconds[name] = round(time.perf_counter() - t0, 4)
        if n_new:                                  # verify sizes are many: one event for all of them below
            ctx.emit("warmup_shape", shape=name, prompt_tokens=n_tokens, new_tokens=n_new, seconds=seconds[name])
        if ctx.status is not None:
            ctx.status.update(warmup_done=i + 1, warmup_seconds=dict(seconds))
    if verify is not None:
        verify.close()
    vs = {k: v for k, v in seconds.items() if k.startswith("verify_")}
    if vs:
        ctx.emit("warmup_verify", sizes=f"1..{len(vs)}", seconds=round(sum(vs.values()), 4),
                 slowest=max(vs, key=vs.get))
    graphs = "skipped"
    if capture:
        st = engine.graph_stats()
        seconds["cuda_graphs"] = round(st["capture_s"], 4)
        graphs = f"{st['graphs']} captured (rows {','.join(map(str, buckets))})"
    total = round(time.perf_counter() - t_all, 4)
    if ctx.status is not None:
        ctx.status.update(warmup_seconds=dict(seconds), warmup_total_s=total)
    ctx.emit("warmup_done", seconds=total, shapes=len(shapes), cuda_graphs=graphs)
    return {"seconds": total, "shapes": seconds, "cuda_graphs": graphs}
