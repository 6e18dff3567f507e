"""warmup: run every decode shape once before the port says ready, so the first user request does not pay
for first-touch allocations, lazy imports or (backend=cuda) kernel selection; seconds per shape land in
status.json (`warmup_seconds`) and events.jsonl.

Shapes: prefill at a few prompt lengths, then decode rounds. With a drafter, a decode round verifies a
tree of tree.budget nodes (the tree builder fills the budget), so a short generation covers the verify
shape; without one (tree=ar) it is the 1-token decode step. CUDA graph capture belongs here for
backend=cuda (engine.capture_graphs, when the engine has it); the numpy/cpu backends have nothing to capture.
"""
from __future__ import annotations

import time
from typing import List, Tuple

SIDE = "host"
PARAMS = {}
PREFILL_LENGTHS = (1, 16, 128)     # tokens; capped by the context


def warmup_shapes(cfg, engine) -> List[Tuple[str, int, int]]:
    """(name, prompt tokens, new tokens) per shape."""
    room = int(engine.max_context) - int(cfg.tree.budget) - 2 - 8
    shapes = [(f"prefill_{n}", n, 1) for n in PREFILL_LENGTHS if n <= room]
    if getattr(engine, "drafter", None) is not None and cfg.tree.kind != "ar":
        steps = int(cfg.tree.depth) + 2             # at least one full verify round after the prefill
        shapes.append((f"verify_tree_{int(cfg.tree.budget)}", 4, steps))
    else:
        shapes.append(("decode_1", 4, 4))
    return shapes


def run(ctx) -> dict:
    engine = ctx.state.get("model_engine")
    if engine is None:
        from kdtree.errors import PipelineError
        raise PipelineError("stage warmup: no engine in this process; put `{stage: load, on: host}` before warmup")
    shapes = warmup_shapes(ctx.cfg, engine)
    base = list(engine.tokenizer.encode("The quick brown fox jumps over the lazy dog. ")) or [0]
    seconds = {}
    if ctx.status is not None:
        ctx.status.update(phase="warmup", warmup_total=len(shapes), warmup_done=0, warmup_seconds={})
    t_all = time.perf_counter()
    for i, (name, n_prompt, n_new) in enumerate(shapes):
        prompt = (base * (n_prompt // len(base) + 1))[:n_prompt]
        if ctx.status is not None:
            ctx.status.update(warmup_shape=name)
        t0 = time.perf_counter()
        engine.generate(prompt, n_new)
        seconds[name] = round(time.perf_counter() - t0, 4)
        ctx.emit("warmup_shape", shape=name, prompt_tokens=n_prompt, new_tokens=n_new, seconds=seconds[name])
        if ctx.status is not None:
            ctx.status.update(warmup_done=i + 1, warmup_seconds=dict(seconds))
    graphs = "skipped"
    if ctx.cfg.backend.name == "cuda" and hasattr(engine, "capture_graphs"):
        t0 = time.perf_counter()
        engine.capture_graphs()
        seconds["cuda_graphs"] = round(time.perf_counter() - t0, 4)
        graphs = "captured"
    total = round(time.perf_counter() - t_all, 4)
    if ctx.status is not None:
        ctx.status.update(warmup_seconds=dict(seconds), warmup_total_s=total)
    ctx.emit("warmup_done", seconds=total, shapes=len(shapes), cuda_graphs=graphs)
    return {"seconds": total, "shapes": seconds, "cuda_graphs": graphs}
