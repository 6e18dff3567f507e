"""The bench pipelines time every prompt with a cold prefill: bench repeats its prompts round after round (and
bench_peer resets llama.cpp before each one), so with the engine's prefix cache on, kdtree would prefill a prompt
only in its first run -- on k26_mini that made kdtree's bench_peer tokens/s 1.22x its cold figure."""
from __future__ import annotations

from kdtree.engine import AR_TREE, Engine
from kdtree.stages.bench import _run_set, load_prompts


def test_bench_runs_prefill_every_prompt_and_leave_the_prefix_cache_as_it_was(compose_cfg):
    engine = Engine.from_config(compose_cfg("backend=numpy", "load.progress=false"))
    try:
        prompts = [list(map(int, engine.tokenizer.encode(t))) for t in load_prompts("")]
        assert max(map(len, prompts)) > 16   # longer than a page: a second run would hit the cache
        cache = engine.scheduler.prefix_cache
        engine.generate(prompts[1], 4)        # a request before the bench: its prompt's pages are cached now
        before = cache.stats()
        runs = [_run_set(engine, prompts, 4, AR_TREE) for _ in range(2)]
        during = cache.stats()
        # no lookup and no insert while the bench ran: every prompt prefilled cold, in both rounds
        assert (during["prefix_cache_queries"], during["prefix_cache_hits"], during["prefix_cache_tokens"]) == \
            (before["prefix_cache_queries"], before["prefix_cache_hits"], before["prefix_cache_tokens"])
        assert [p["tokens"] for p in runs[0]["per_prompt"]] == [p["tokens"] for p in runs[1]["per_prompt"]]
        assert all(r["stage_seconds"]["prefill"] > 0 for r in runs)
        # afterwards the cache serves requests again, as before the bench
        assert engine.scheduler.prefix_enabled
        engine.generate(prompts[1], 4)
        assert cache.stats()["prefix_cache_hits"] > before["prefix_cache_hits"]
    finally:
        engine.close()
