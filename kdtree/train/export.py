"""Write the trained tiny model as the embedded checkpoint: HF layout target + drafter/ + TRAINING.md.

Uses the checkpoint writer (kdtree/checkpoint/writer.py) and config.json builders (hf_config.py), so
the directory loads with kdtree.checkpoint.loader like any checkpoint. Provenance (corpus files and
hashes), the training arguments and the loss/acceptance histories go to TRAINING.md and training.json.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, List, Mapping, Optional

import numpy as np

from safetensors.numpy import load_file, save_file

from kdtree.checkpoint.hf_config import drafter_config_json, target_config_json
from kdtree.checkpoint.writer import write_checkpoint
from kdtree.model.names import drafter_tensor_shapes, target_tensor_shapes
from kdtree.train.evaluate import table

SHARD_BYTES = 4 * 2 ** 20   # the same shard size as the generated tiny checkpoint


def save_tensors(path: Path, tensors) -> None:
    """A work dir's weights file (target/drafter .safetensors of `python -m kdtree.train.run`)."""
    save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, str(path))


def load_tensors(path: Path) -> Dict[str, np.ndarray]:
    return dict(load_file(str(path)))


def _check(tensors: Mapping[str, np.ndarray], shapes: Mapping[str, tuple], what: str) -> Dict[str, np.ndarray]:
    out = {}
    for name, shape in shapes.items():
        if name not in tensors or tuple(tensors[name].shape) != tuple(shape):
            raise ValueError(f"{what}: tensor {name} missing or not of shape {list(shape)}")
        out[name] = np.ascontiguousarray(tensors[name], np.float32)
    return out


def write_assets(cfg, target: Mapping[str, np.ndarray], drafter: Mapping[str, np.ndarray], out: Path,
                 info: Optional[dict] = None, training_md: str = "") -> Path:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for old in list(out.glob("model*.safetensors")) + list((out / "drafter").glob("*.safetensors")):
        old.unlink()
    write_checkpoint(out, _check(target, target_tensor_shapes(cfg), "target"), target_config_json(cfg), SHARD_BYTES)
    write_checkpoint(out / "drafter", _check(drafter, drafter_tensor_shapes(cfg), "drafter"), drafter_config_json(cfg), 0)
    if info is not None:
        (out / "training.json").write_text(json.dumps(info, indent=1) + "\n")
    if training_md:
        (out / "TRAINING.md").write_text(training_md)
    return out


def _drafter_history(d: dict) -> List[str]:
    """The drafter's loss and held-out acceptance per evaluation step, as a table."""
    return ["| step | loss | ema | chain acceptance | acc per depth | seconds |", "|---|---|---|---|---|---|",
            *[f"| {h['step']} | {h['loss']} | {h['loss_ema']} | {h.get('chain_acceptance', '')} | "
              f"{h.get('acc_per_depth', '')} | {h['seconds']} |" for h in d["history"]]]


def _acceptance(ev: dict) -> List[str]:
    """The numpy engine's acceptance table on held-out prompts (kdtree.train.evaluate) and its command."""
    return ["", "## Acceptance (numpy engine, held-out prompts)", "",
            f"{ev['n_prompts']} prompts of {ev['prompt_len']} bytes (line starts of held-out files), "
            f"{ev['max_new_tokens']} new tokens, greedy. mean acceptance = tokens committed per verify forward.", "",
            table(ev), "", f"Command: `{ev.get('command', '')}`"]


def training_md(info: dict, commands: str = "") -> str:
    """TRAINING.md: what was trained on what, with which settings, reaching which losses and acceptance."""
    t, d, ev = info["target"], info["drafter"], info.get("eval")
    c = t["corpus"]
    held = [r["file"] for r in c["files"] if r["heldout"]]
    L = ["# The trained tiny K2 checkpoint", "",
         "Target: the tiny K2 (DeepSeek-V3 architecture, conf/model/tiny.yaml) trained as a byte-level LM;",
         "drafter: its DFlash block drafter distilled on the target's own greedy continuations.",
         "Code: kdtree/train/ (torch, CPU). Weights fp32, tensor names of kdtree/model/names.py.", "",
         "## Data", "",
         f"* {c['source']}; Python {c['python']} ({c['stdlib']}), {c['n_files']} files, each as",
         "  bos(256) + utf-8 bytes + eos(257)" + (f", at most {c['max_bytes_per_file']} bytes per file" if c.get("max_bytes_per_file") else "") + ".",
         f"* corpus sha256 (over name + NUL + bytes of every file, in order): `{c['corpus_sha256']}`",
         f"* held out ({c['heldout_rule']}): {len(held)} files, {c['heldout_tokens']} tokens: {', '.join(held)}",
         f"* train: {c['train_tokens']} tokens. Per-file sizes and sha256: training.json (target.corpus.files).", "",
         "## Target", "",
         f"* args: `{json.dumps(t.get('args', info.get('params', {})))}`",
         f"* steps done: {t['steps_done']}; router bias: aux-loss-free balancing (bias += 1e-3 * sign(mean load - load)",
         "  after every step; the bias gets no gradient); expert loads of the last batch: "
         f"{t.get('last_expert_load')}", "",
         "| step | train loss (nats/byte) | ema | held-out loss | seconds |", "|---|---|---|---|---|"]
    L += [f"| {h['step']} | {h['train_loss']} | {h['train_loss_ema']} | {h['heldout_loss']} | {h['seconds']} |"
          for h in t["history"]]
    L += ["", "## Drafter", "",
          f"* args: `{json.dumps(d.get('args', {}))}`",
          f"* greedy data: `{json.dumps(d.get('greedy_args', {}))}`",
          "* objective: for anchors a in the greedy continuation, block [tok[a], MASK x 7] over the target",
          "  hiddens (layers target_layer_ids) of rows < a predicts tok[a+1..a+7]; CE weighted exp(-(j-1)/decay).",
          "* acc@j / chain = top-1 accuracy per depth and expected chain acceptance on held-out greedy data.",
          f"* steps done: {d['steps_done']}", "",
          *_drafter_history(d)]
    if ev:
        L += [*_acceptance(ev), "", "Sample greedy continuations (AR):", ""]
        L += ["```", *[repr(s) for s in ev.get("ar_samples", [])], "```"]
    if commands:
        L += ["", "## Commands", "", "```", commands.strip(), "```"]
    return "\n".join(L) + "\n"


def export_assets(cfg, work: Path, out: Path) -> Path:
    """From a `python -m kdtree.train.run` work dir (target/drafter .safetensors + .json)."""
    work = Path(work)
    t = json.loads((work / "target.json").read_text())
    d = json.loads((work / "drafter.json").read_text())
    ev = json.loads((work / "eval.json").read_text()) if (work / "eval.json").exists() else None
    info = {"target": t, "drafter": d, "eval": ev}
    cmds = (work / "COMMANDS").read_text() if (work / "COMMANDS").exists() else ""
    return write_assets(cfg, load_tensors(work / "target.safetensors"), load_tensors(work / "drafter.safetensors"),
                        out, info, training_md(info, cmds))


def drafter_md(info: dict, commands: str = "") -> str:
    """TRAINING.md of a drafter shipped beside the default one (kdtree/assets/tiny/drafter_b<B>)."""
    d, ev = info["drafter"], info.get("eval")
    B = d["block_size"]
    L = [f"# The tiny K2's DFlash drafter of block size {B}", "",
         f"Distilled from the same trained target as kdtree/assets/tiny/drafter (block size 8), on the same greedy",
         f"continuations (../TRAINING.md), with block [tok[a], MASK x {B - 1}]: it drafts {B - 1} tokens per round",
         f"(tree.depth <= {B - 1}). CE weighted exp(-(j-1)/decay); decay {d['args']['decay']}.",
         f"Select it with model.drafter.block_size={B}.", "",
         f"* args: `{json.dumps(d.get('args', {}))}`",
         f"* greedy data: `{json.dumps(d.get('greedy_args', {}))}`",
         f"* steps done: {d['steps_done']}", "", *_drafter_history(d)]
    if ev:
        L += _acceptance(ev)
    if commands:
        L += ["", "## Commands", "", "```", commands.strip(), "```"]
    return "\n".join(L) + "\n"


def export_drafter(cfg, work: Path, out: Path) -> Path:
    """A `python -m kdtree.train.run drafter --drafter-block B` work dir's drafter as a drafter checkpoint
    (config.json + model.safetensors + TRAINING.md + training.json) in `out`."""
    work, out = Path(work), Path(out)
    d = json.loads((work / "drafter.json").read_text())
    d["block_size"] = int(cfg.drafter.block_size)
    ev = json.loads((work / "eval.json").read_text()) if (work / "eval.json").exists() else None
    info = {"drafter": d, "eval": ev}
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("*.safetensors"):
        old.unlink()
    write_checkpoint(out, _check(load_tensors(work / "drafter.safetensors"), drafter_tensor_shapes(cfg), "drafter"),
                     drafter_config_json(cfg), 0)
    (out / "training.json").write_text(json.dumps(info, indent=1) + "\n")
    cmds = (work / "COMMANDS").read_text() if (work / "COMMANDS").exists() else ""
    (out / "TRAINING.md").write_text(drafter_md(info, cmds))
    return out
