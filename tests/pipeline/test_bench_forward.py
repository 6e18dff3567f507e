"""pipeline=bench_forward: one target forward of T rows against this host's roofs measured in the same run, with
the bytes it must stream (dense + the union of its rows' routed experts, counted by the forward itself)."""
from __future__ import annotations

import json

import numpy as np

from tests.native_lib import needs_cpu_library
from tests.serve.served_engine import kdtree_run


@needs_cpu_library
def test_bench_forward_curve_has_roofs_bytes_and_the_expert_union(kdtree_cache, tmp_path):
    run_dir = tmp_path / "bf"
    r = kdtree_run(["pipeline=bench_forward", "backend=cpu", "bench_forward.rows=[1,2,9]", "bench_forward.threads=[1]",
                    "bench_forward.repeats=1", "bench_forward.roof_mb=32", f"hydra.run.dir={run_dir}"],
                   kdtree_cache, tmp_path, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    out = json.loads((run_dir / "bench_forward.json").read_text())
    assert out["roofs"]["1"]["read_gb_s"] > 0.5 and out["roofs"]["1"]["fma_gflop_s"] > 1
    rows = {x["rows"]: x for x in out["rows"]}
    assert sorted(rows) == [1, 2, 9] and rows[1]["ratio_to_t1"] == 1.0
    # tiny: 8 experts, top-2 -> one row streams exactly 2 experts per MoE layer; 9 rows stream more, at most all 8
    assert set(rows[1]["experts_per_layer"].values()) == {2.0}
    u9 = list(rows[9]["experts_per_layer"].values())
    assert len(u9) == 3 and all(2.0 < u <= 8.0 for u in u9)
    assert rows[9]["expert_bytes"] > rows[1]["expert_bytes"] and rows[9]["dense_bytes"] == rows[1]["dense_bytes"]
    assert rows[9]["flops"] > 8 * rows[1]["flops"]
    for x in rows.values():
        assert 0 < x["roofline_share"] <= x["op_roofline_share"] * (1 + 1e-9) and x["bound"] in ("memory", "compute")
        assert "op_costs" not in x
        assert x["read_near_gb_s"] is None and x["read_gb_s"] == out["roofs"]["1"]["read_gb_s"]   # tiny: in cache
    assert "| threads | T | seconds |" in r.stdout and (run_dir / "bench_forward.png").stat().st_size > 1000
    assert out["load_strategy"] == "mmap" and out["held_weights_mb"] > 0
    assert set(out["huge_mapped_mb"]) == {"file", "anon"}


def test_weights_hint_names_the_page_cache_and_the_fix_only_when_they_stream_slowly(tmp_path):
    # an 11th-session VM: mmap'd weights re-read after memory pressure sat in small page-cache folios and streamed at
    # 0.77 of a fresh buffer (306 of 6385 MB mapped in 2 MB pages); eager copies streamed at 0.98
    from kdtree.stages.bench_forward import _huge_mapped_mb, weights_hint
    slow = {1: {"read_buffer_gb_s": 17.0, "read_weights_gb_s": 16.5}, 2: {"read_buffer_gb_s": 33.9,
                                                                          "read_weights_gb_s": 26.0}}
    hint = weights_hint(slow, "mmap", {"file": 306, "anon": 0}, 6385.0)
    assert "0.77 of a fresh buffer" in hint and "(2 thr)" in hint and "306 of 6385 MB" in hint
    assert "load.strategy=eager" in hint
    eager = weights_hint(slow, "eager", {"file": 0, "anon": 120}, 6385.0)
    assert "load.strategy=eager: 120 of 6385 MB" in eager and "transparent_hugepage/enabled" in eager
    fast = {2: {"read_buffer_gb_s": 32.3, "read_weights_gb_s": 31.5}}
    assert weights_hint(fast, "mmap", {"file": 0, "anon": 0}, 6385.0) == ""
    assert weights_hint({1: {"read_buffer_gb_s": 17.0, "read_weights_gb_s": None}}, "mmap", {}, 1.0) == ""  # in cache
    rollup = tmp_path / "smaps_rollup"
    rollup.write_text("Rss:  7000000 kB\nAnonHugePages:   6684672 kB\nFilePmdMapped:    313344 kB\n")
    assert _huge_mapped_mb(str(rollup)) == {"file": 306, "anon": 6528}
    assert _huge_mapped_mb(str(tmp_path / "missing")) == {"file": 0, "anon": 0}


@needs_cpu_library
def test_moe_stats_count_the_same_union_on_the_native_and_numpy_targets(compose_cfg):
    from kdtree.engine import Engine

    ids = np.arange(40, 60, dtype=np.int32)
    stats = []
    for backend in ("cpu", "numpy"):
        t = Engine.from_config(compose_cfg(f"backend={backend}", "load.progress=false")).model
        cache = t.new_cache(64)
        t.moe_stats(reset=True)
        t.forward(ids[:12], np.arange(12, dtype=np.int32), cache)
        t.forward(ids[12:13], np.array([12], np.int32), cache)
        stats.append(t.moe_stats(reset=True))
        assert t.moe_stats() == {}                        # reset
    assert stats[0] == stats[1]
    assert all(s == {"forwards": 2, "experts": s["experts"], "rows": 13} and 4 <= s["experts"] <= 10
               for s in stats[0].values())


@needs_cpu_library
def test_the_read_roof_is_the_faster_of_a_fresh_buffer_and_the_forwards_own_weights(compose_cfg):
    """A roof a forward can beat is none: on a VM one fresh buffer's pages streamed at 12.8 GB/s on one thread where
    the weights' own pages streamed at 33 and a one-row forward read 17.9 (share 1.40). The roof also reads the
    weights, where they outgrow the caches."""
    from kdtree.engine import Engine
    from kdtree.stages.bench_forward import WEIGHT_ROOF_MIN_MB, _table, roofs, weights_reader

    t = Engine.from_config(compose_cfg("backend=cpu", "load.progress=false")).model
    held = t.held_arrays()
    assert len({a.ctypes.data for a in held}) == len(held)            # each memory block once
    assert sum(a.nbytes for a in held) >= sum(b for b, _ in t.weight_bytes().values())
    tiny = roofs(t.lib, 1, 16, repeats=1, arrays=held)                # tiny's weights fit the caches: buffer only
    assert tiny["read_weights_gb_s"] is None and tiny["read_gb_s"] == tiny["read_buffer_gb_s"] > 0.5
    big = [np.ones(8 << 20, np.float32) for _ in range(WEIGHT_ROOF_MIN_MB // 32 + 1)]   # 32 MiB each
    r = roofs(t.lib, 1, 16, repeats=1, arrays=big)
    assert r["read_weights_gb_s"] > 0.5
    assert r["read_gb_s"] == max(r["read_buffer_gb_s"], r["read_weights_gb_s"])
    # each point also reads the weights beside its forwards (this VM's memory switches between ~33 and ~46-57 GB/s
    # for seconds at a time): the point's roof is the faster of that read and the run's
    sweep = weights_reader(t.lib, big, 1)
    assert weights_reader(t.lib, held, 1) is None and sweep() > 0.5
    row = {"threads": 1, "rows": 1, "seconds": 1.0, "bytes": 40e9, "flops": 1e9}
    slow, fast = _table([dict(row, read_near_gb_s=10.0), dict(row, read_near_gb_s=50.0)],
                        {1: {"read_gb_s": 20.0, "fma_gflop_s": 100.0}})
    assert (slow["read_gb_s"], fast["read_gb_s"]) == (20.0, 50.0)
    assert (slow["roofline_share"], fast["roofline_share"]) == (2.0, 0.8)


def test_the_per_matrix_roofline_sums_each_matrix_against_its_own_bound():
    """A compute-bound dense layer cannot hide behind memory-bound experts in a forward that runs its matrices one
    after another: max(all bytes, all FLOPs) is 2 s here, the matrices one by one 2 + 1 s."""
    from types import SimpleNamespace

    from kdtree.stages.bench_forward import _table, forward_cost

    row = {"threads": 1, "rows": 9, "seconds": 4.0, "bytes": 40e9, "flops": 100e9,
           "op_costs": [(40e9, 0.0), (0.0, 100e9)]}
    (r,) = _table([row], {1: {"read_gb_s": 20.0, "fma_gflop_s": 100.0}})
    assert (r["roofline_s"], r["op_roofline_s"]) == (2.0, 3.0) and r["op_roofline_share"] == 0.75
    # forward_cost's matrices add up to its bytes and FLOPs (routed experts: the union's bytes, all rows' FLOPs)
    cfg = SimpleNamespace(n_routed_experts=4, num_experts_per_tok=2, kv_lora_rank=8, qk_rope_head_dim=4,
                          num_hidden_layers=2, num_attention_heads=2)
    wb = {"model.layers.0.self_attn.q_a_proj": (400, 100), "model.layers.1.mlp.shared_experts.up_proj": (800, 200),
          **{f"model.layers.1.mlp.experts.{e}.{m}": (64, 16) for e in range(4) for m in ("gate", "up", "down")}}
    c = forward_cost(cfg, wb, {1: {"experts": 3, "forwards": 1, "rows": 9}}, 9, 5)
    assert sum(b for b, _ in c["op_costs"]) == c["bytes"] and sum(f for _, f in c["op_costs"]) == c["flops"]
    assert c["expert_bytes"] == 3 * 3 * 64
