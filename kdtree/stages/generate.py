"""generate: one greedy completion without a server; prints it and writes result.json in the run dir."""
from __future__ import annotations

import json

from kdtree.engine import Engine, EngineState
from kdtree.serve.status import make_status  # noqa: F401  (declared: the engine process's status.json)

SIDE = "host"
PARAMS = {"prompt": str, "max_new_tokens": int}


def run(ctx, prompt: str, max_new_tokens: int) -> dict:
    state = EngineState.of(ctx)
    if state.engine is None:
        state.engine = Engine.from_config(ctx.cfg, status=ctx.status)
    engine = state.engine
    prompt_ids = engine.tokenizer.encode(prompt)
    result = engine.generate(prompt_ids, max_new_tokens)
    text = engine.tokenizer.decode(result.tokens)
    out = {
        "prompt": prompt,
        "text": text,
        "prompt_tokens": list(map(int, prompt_ids)),
        **result.to_dict(),
        "target_forwards_per_token": result.target_forwards / max(len(result.tokens), 1),
        "tree": dict(kind=ctx.cfg.tree.kind, width=ctx.cfg.tree.width, depth=ctx.cfg.tree.depth,
                     budget=ctx.cfg.tree.budget),
        "backend": ctx.cfg.backend.name,
        "quant": ctx.cfg.quant.method,
        "model": ctx.cfg.model.name,
    }
    (ctx.run_dir / "result.json").write_text(json.dumps(out, indent=2))
    print(f"{prompt}{text}")
    print(f"[{len(result.tokens)} tokens, {result.target_forwards} target forwards, "
          f"mean acceptance {result.mean_acceptance_length:.2f}, {result.seconds:.2f} s, "
          f"finish={result.finish_reason}] -> {ctx.run_dir / 'result.json'}")
    return {"tokens": len(result.tokens), "target_forwards": result.target_forwards, "seconds": result.seconds}
