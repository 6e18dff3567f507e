"""demo: one completion of a fixed prompt with the composed tree and with plain AR, in the engine process,
so a newcomer sees what the model writes, the acceptance length and the speedup over AR measured side by
side (the same weights, the same process, the same prompt). Prints three lines; fails if the tree's
tokens differ from AR's (the lossless invariant). serve.demo_tokens=0 skips it."""
from __future__ import annotations

from kdtree.engine import AR_TREE, EngineState
from kdtree.errors import PipelineError
from kdtree.serve.status import make_status  # noqa: F401  (declared: the engine process's status.json)

SIDE = "host"


def run(ctx) -> dict:
    prompt, max_new_tokens = ctx.cfg.serve.demo_prompt, int(ctx.cfg.serve.demo_tokens)  # serve's demo
    if max_new_tokens <= 0:
        return {"skipped": True}
    engine = EngineState.of(ctx).engine
    if engine is None:
        raise PipelineError("stage demo: no engine in this process; put `{stage: load, on: host}` before demo")
    ids = engine.tokenizer.encode(prompt)
    ar = engine.generate(ids, max_new_tokens, tree=AR_TREE)
    tree = engine.generate(ids, max_new_tokens) if engine.drafter is not None else ar
    if tree.tokens != ar.tokens:
        raise PipelineError(f"demo: tree={ctx.cfg.tree.kind} tokens differ from AR for prompt {prompt!r}: the "
                            f"lossless invariant is broken; report this as a bug")
    t = ctx.cfg.tree
    speedup = ar.seconds / max(tree.seconds, 1e-9)
    print(f"demo prompt     {prompt!r}", flush=True)
    print(f"demo completion {engine.tokenizer.decode(tree.tokens)!r}", flush=True)
    print(f"demo {t.kind} w={t.width} d={t.depth} b={t.budget}: {len(tree.tokens)} tokens in {tree.target_forwards} "
          f"target forwards (mean acceptance {tree.mean_acceptance_length:.2f}), {tree.seconds:.2f} s; "
          f"AR: {ar.target_forwards} forwards, {ar.seconds:.2f} s -> speedup {speedup:.2f}x", flush=True)
    out = {"prompt": prompt, "tokens": len(tree.tokens), "target_forwards": tree.target_forwards,
           "ar_target_forwards": ar.target_forwards, "mean_acceptance_length": tree.mean_acceptance_length,
           "seconds": tree.seconds, "ar_seconds": ar.seconds, "speedup_vs_ar": speedup}
    ctx.emit("demo", **{k: (round(v, 4) if isinstance(v, float) else v) for k, v in out.items()})
    if ctx.status is not None:
        ctx.status.update(demo={k: v for k, v in out.items() if k != "prompt"})
    return out
