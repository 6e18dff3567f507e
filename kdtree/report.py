"""Aggregate a bench sweep (Hydra multirun dir) into report.md, report.csv and report.png.

    python -m kdtree.report runs/multirun/2026-11-30/10-00-00

One row per run (its bench.json) and per shape of its bench.trees, plus each model's AR baseline; the best
configuration by speedup is marked; AR, chain (width 1) and DDTree rows are shown side by side. The plot shows
tokens/s relative to AR and mean acceptance length vs budget, one line per (model, kind, width, depth): a directory
holding bench runs of several models (e.g. tiny and tiny_wide) gives one plot of both; runs of one model with drafters
of different block sizes (bench.json `drafter_block_size`) are labelled apart.
"""
from __future__ import annotations

import csv
import json
import sys
from pathlib import Path
from typing import List

COLUMNS = ["model", "kind", "width", "depth", "budget", "temperature", "tokens_per_s", "speedup_vs_ar",
           "mean_acceptance_length", "greedy_mean_acceptance_length", "target_forwards_per_token", "outputs_equal_ar",
           "run"]


def _row(b: dict, t: dict, run: str, **vals) -> dict:
    kind = "chain" if t["kind"] != "ar" and t["width"] == 1 else t["kind"]
    if t.get("policy", "fixed") != "fixed":
        kind += f" ({t['policy']})"
    if t.get("prune_experts"):
        kind += " prune"
    return {"model": f"{b.get('model', '')} {b.get('quant', '')}".strip(),
            "drafter_block_size": b.get("drafter_block_size"), "kind": kind, "width": t["width"], "depth": t["depth"],
            "budget": t["budget"], "temperature": b.get("temperature", 0.0), "run": run,
            "ar_tokens_per_s": b["ar_tokens_per_s"], "ar_target_forwards_per_token": b["ar_target_forwards_per_token"],
            **vals}


def collect(sweep_dir: Path) -> List[dict]:
    """One row per bench.json, and one per shape of its bench.trees (the same run's AR baseline)."""
    rows = []
    for f in sorted(sweep_dir.glob("**/bench.json")):
        b = json.loads(f.read_text())
        run = str(f.parent.relative_to(sweep_dir))
        rows.append(_row(b, b["tree"], run, tokens_per_s=b["tokens_per_s"], speedup_vs_ar=b["speedup_vs_ar"],
                         mean_acceptance_length=b["mean_acceptance_length"],
                         greedy_mean_acceptance_length=b.get("greedy_mean_acceptance_length",
                                                             b["mean_acceptance_length"]),
                         target_forwards_per_token=b["target_forwards_per_token"],
                         outputs_equal_ar=b["outputs_equal_ar"]))
        for x in b.get("trees", []):
            rows.append(_row(b, x["tree"], run, tokens_per_s=x["tokens_per_s"], speedup_vs_ar=x["speedup_vs_ar"],
                             mean_acceptance_length=x["mean_acceptance_length"],
                             greedy_mean_acceptance_length=x["mean_acceptance_length"],
                             target_forwards_per_token=x["target_forwards_per_token"],
                             outputs_equal_ar=x["outputs_equal_ar"]))
    return _name_drafters(rows)


def _name_drafters(rows: List[dict]) -> List[dict]:
    """Runs of one model and quant with drafters of different block sizes (bench.json `drafter_block_size`) are
    different models to the table and the plot: their labels gain ", drafter block B" (and each its own AR row)."""
    for m in {r["model"] for r in rows}:
        mine = [r for r in rows if r["model"] == m]
        if len({r["drafter_block_size"] for r in mine}) > 1:
            for r in mine:
                B = r["drafter_block_size"]
                r["model"] = f"{m}, drafter block {B if B is not None else '?'}"
    return rows


def _ar_row(rows: List[dict]) -> dict:
    tps = sorted(r["ar_tokens_per_s"] for r in rows)
    return {"model": "", "kind": "ar", "width": 1, "depth": 0, "budget": 0, "tokens_per_s": tps[len(tps) // 2],
            "speedup_vs_ar": 1.0, "mean_acceptance_length": 1.0, "greedy_mean_acceptance_length": 1.0,
            "temperature": "-",
            "target_forwards_per_token": rows[0]["ar_target_forwards_per_token"], "outputs_equal_ar": True,
            "run": f"median of the {len(rows)} in-run baselines"}


def write_report(sweep_dir: Path) -> dict:
    rows = collect(sweep_dir)
    if not rows:
        raise SystemExit(f"kdtree.report: no bench.json under {sweep_dir}; run "
                         f"`python -m kdtree.run -m pipeline=bench tree.width=1,2 ...` first")
    best = max(rows, key=lambda r: r["speedup_vs_ar"])
    order = {"ar": 0, "chain": 1, "ddtree": 2}
    models = sorted({r["model"] for r in rows})
    # one AR row per model: its in-run baselines' median (tokens/s of different models are not comparable)
    table = []
    for m in models:
        mine = [r for r in rows if r["model"] == m]
        table += [{**_ar_row(mine), "model": m}] + sorted(mine, key=lambda r: (
            order.get(r["kind"].split()[0], 3), r["width"], r["depth"], r["budget"], str(r["temperature"])))
    with open(sweep_dir / "report.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS + ["best"], extrasaction="ignore")
        w.writeheader()
        for r in table:
            w.writerow({**r, "best": r is best})
    lines = [f"# Bench sweep: {sweep_dir}", "",
             f"Best by speedup: **{best['kind']} width={best['width']} depth={best['depth']} budget={best['budget']}"
             f"** — {best['speedup_vs_ar']:.2f}x over AR, mean acceptance {best['mean_acceptance_length']:.2f}.", "",
             "| | model | kind | width | depth | budget | temperature | tok/s | speedup vs AR | mean acceptance "
             "| greedy acceptance | target fwd/token | lossless |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in table:
        lines.append(f"| {'**best**' if r is best else ''} | {r['model']} | {r['kind']} | {r['width']} | "
                     f"{r['depth']} | {r['budget']} | {r['temperature']} | {r['tokens_per_s']:.1f} | "
                     f"{r['speedup_vs_ar']:.2f} | {r['mean_acceptance_length']:.2f} | "
                     f"{r['greedy_mean_acceptance_length']:.2f} | {r['target_forwards_per_token']:.3f} | "
                     f"{'yes' if r['outputs_equal_ar'] else 'NO'} |")
    lines += ["", "![speedup and acceptance vs budget](report.png)", ""]
    (sweep_dir / "report.md").write_text("\n".join(lines))
    _plot(rows, sweep_dir / "report.png")
    return {"rows": len(rows), "best": best}


def _plot(rows: List[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4.2))
    keys = sorted({(r["model"], r["kind"], r["width"], r["depth"]) for r in rows})
    for key in keys:
        m, kind, w, d = key
        pts = sorted((r["budget"], r["speedup_vs_ar"], r["mean_acceptance_length"]) for r in rows
                     if (r["model"], r["kind"], r["width"], r["depth"]) == key)
        label = (f"{m}: " if len({k[0] for k in keys}) > 1 else "") + f"{kind} w={w} d={d}"
        a1.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
        a2.plot([p[0] for p in pts], [p[2] for p in pts], marker="o", label=label)
    a1.axhline(1.0, color="grey", linestyle="--", linewidth=1, label="AR")
    a2.axhline(1.0, color="grey", linestyle="--", linewidth=1, label="AR")
    for ax, title in ((a1, "tokens/s relative to AR (same run)"), (a2, "mean acceptance length (tokens/round)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tree budget (nodes)")
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
    a2.legend(fontsize=7, loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m kdtree.report <dir with bench.json files: a multirun dir, or runs of several models>",
              file=sys.stderr)
        return 2
    d = Path(argv[0])
    if not d.is_dir():
        print(f"kdtree.report: {d} is not a directory; give the multirun dir of a bench sweep", file=sys.stderr)
        return 2
    out = write_report(d)
    b = out["best"]
    print(f"{out['rows']} runs -> {d / 'report.md'}, report.csv, report.png; best: {b['kind']} w={b['width']} "
          f"d={b['depth']} b={b['budget']} ({b['speedup_vs_ar']:.2f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
