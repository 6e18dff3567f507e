"""generate: one completion without a server; prints it and writes result.json in the run dir.

Greedy by default; sampling.temperature > 0 samples (sampling.* keys; seed in result.json replays it) and
result.json then also holds the greedy acceptance length of the same prompt and tree next to the sampled one.
"""
from __future__ import annotations

import json

from kdtree.engine import Engine, EngineState
from kdtree.serve.status import make_status  # noqa: F401  (declared: the engine process's status.json)

SIDE = "host"


def run(ctx) -> dict:
    prompt, max_new_tokens = ctx.cfg.prompt, int(ctx.cfg.max_new_tokens)  # the root keys: prompt=... max_new_tokens=...
    state = EngineState.of(ctx)
    if state.engine is None:
        state.engine = Engine.from_config(ctx.cfg, status=ctx.status)
    engine = state.engine
    prompt_ids = engine.tokenizer.encode(prompt)
    sampling = engine.pipeline_sampling()
    results = engine.generate_n(prompt_ids, max_new_tokens, sampling) if sampling.n > 1 else \
        [engine.generate(prompt_ids, max_new_tokens, sampling=sampling)]
    result = results[0]
    text = engine.tokenizer.decode(result.tokens)
    out = {
        "prompt": prompt,
        "text": text,
        "prompt_tokens": list(map(int, prompt_ids)),
        **result.to_dict(),
        "target_forwards_per_token": result.target_forwards / max(len(result.tokens), 1),
        "sampling": sampling.to_dict(),
        "tree": dict(kind=ctx.cfg.tree.kind, width=ctx.cfg.tree.width, depth=ctx.cfg.tree.depth,
                     budget=ctx.cfg.tree.budget),
        "backend": ctx.cfg.backend.name,
        "quant": ctx.cfg.quant.method,
        "model": ctx.cfg.model.name,
    }
    if len(results) > 1:
        out["samples"] = [{"text": engine.tokenizer.decode(r.tokens), **r.to_dict()} for r in results]
    if sampling.greedy:
        out["greedy_mean_acceptance_length"] = result.mean_acceptance_length
    else:  # the acceptance length under sampling next to greedy's (it falls as the temperature rises)
        greedy = engine.generate(prompt_ids, max_new_tokens)
        out["greedy_mean_acceptance_length"] = greedy.mean_acceptance_length
    (ctx.run_dir / "result.json").write_text(json.dumps(out, indent=2))
    for r in results:
        print(f"{prompt}{engine.tokenizer.decode(r.tokens)}")
    how = "greedy" if sampling.greedy else f"T={sampling.temperature} seed={result.seed}"
    print(f"[{len(result.tokens)} tokens, {result.target_forwards} target forwards, "
          f"mean acceptance {result.mean_acceptance_length:.2f} ({how}; greedy "
          f"{out['greedy_mean_acceptance_length']:.2f}), {result.seconds:.2f} s, "
          f"finish={result.finish_reason}] -> {ctx.run_dir / 'result.json'}")
    return {"tokens": len(result.tokens), "target_forwards": result.target_forwards, "seconds": result.seconds}
