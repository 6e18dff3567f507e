"""export_gguf: the composed K2-family model as a GGUF file for llama.cpp's `deepseek2` architecture (F32, or BF16
with export_gguf.dtype=bf16 -- the default for quant=bf16, whose weights it keeps exactly).

    python -m kdtree.run pipeline=export_gguf                           # the embedded tiny model
    python -m kdtree.run pipeline=export_gguf export_gguf.path=/tmp/tiny.gguf
    python -m kdtree.run pipeline=export_gguf model=k26 model.path=/ckpt quant=int4_w4a16   # INT4 -> F32

Reads the checkpoint the engine would load (model.path, or the embedded tiny one for quant=...; INT4 experts
are dequantized: the file is F32) and writes it with kdtree/checkpoint/to_gguf.py. path empty =
<run_dir>/<model.name>-<dtype>.gguf. The vocabulary's ids are the project tokenizer's ids. The writer holds every
tensor until it writes the file, and F32 Kimi K2 would be ~4 TB: this is for the tiny model and small checkpoints
with K2's layout (the peer benchmark), not for exporting the real K2.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from omegaconf import OmegaConf

from kdtree.checkpoint import to_gguf
from kdtree.checkpoint.loader import load_checkpoint, load_options
from kdtree.checkpoint.to_gguf import check_dtype, check_exportable, write_gguf
from kdtree.config.paths import cache_dir
from kdtree.engine import resolve_checkpoint
from kdtree.tokenizer import load_tokenizer

SIDE = "any"


@dataclass
class ExportGgufConfig:
    path: str = ""  # the GGUF file to write; empty = <run_dir>/<model.name>-<dtype>.gguf
    dtype: str = ""  # f32 | bf16 (matrices BF16, norms F32) | q8_0 | q4_0; empty = bf16 for quant=bf16, else f32


CONFIG = ExportGgufConfig  # cfg.export_gguf: this stage's options (kdtree/pipeline/registry.py)


def gguf_dtype(cfg) -> str:
    """export_gguf.dtype, or the weights' own: bf16 for quant=bf16 (exact), f32 otherwise."""
    conf = cfg.get("export_gguf") or {}
    return check_dtype(str(conf.get("dtype") or ("bf16" if str(cfg.quant.method) == "bf16" else "f32")))


def default_path(ctx, dtype: str = "f32") -> Path:
    return Path(ctx.run_dir) / f"{ctx.cfg.model.name}-{dtype}.gguf"


def export(ctx, path: str = "", dtype: str = "") -> dict:
    """Write the GGUF of ctx.cfg's model at `path` (empty = default_path) in `dtype` (empty = gguf_dtype(cfg));
    -> {"path", "tensors", "bytes", "dtype"}."""
    cfg = ctx.cfg
    check_exportable(cfg.model)
    dtype = check_dtype(dtype) if dtype else gguf_dtype(cfg)
    ckpt = resolve_checkpoint(cfg)
    weights, _ = load_checkpoint(ckpt, cfg.model, cfg.quant, **load_options(cfg.load, throttle=False))
    out = Path(path).expanduser() if path else default_path(ctx, dtype)
    summary = write_gguf(out, weights, cfg.model, load_tokenizer(cfg.model, ckpt), dtype=dtype)
    ctx.emit("gguf_exported", checkpoint=str(ckpt), path=summary["path"], tensors=summary["tensors"],
             bytes=summary["bytes"])
    print(f"exported {ckpt} -> {summary['path']} (deepseek2, {dtype.upper()}, {summary['tensors']} tensors, "
          f"{summary['bytes'] / 1e6:.1f} MB)")
    return {**summary, "checkpoint": str(ckpt)}


def export_fingerprint(cfg, dtype: str) -> str:
    """What an export's bytes depend on: the checkpoint's files (relative name, size, mtime), the model and quant
    config it is read with, the GGUF type, and the writer's source. 16 hex digits."""
    ckpt = Path(resolve_checkpoint(cfg))
    h = hashlib.sha256()
    for f in sorted(p for p in ([ckpt] if ckpt.is_file() else ckpt.rglob("*")) if p.is_file()):
        st = f.stat()
        h.update(f"{f.relative_to(ckpt) if f != ckpt else f.name}:{st.st_size}:{st.st_mtime_ns}\n".encode())
    h.update(OmegaConf.to_yaml(cfg.model, resolve=True).encode())
    h.update(OmegaConf.to_yaml(cfg.quant, resolve=True).encode())
    h.update(dtype.encode())
    h.update(Path(to_gguf.__file__).read_bytes())
    return h.hexdigest()[:16]


def cached_export(ctx, dtype: str = "") -> dict:
    """The GGUF of ctx.cfg's model in `dtype` (empty = gguf_dtype(cfg)), exported once into <cache_dir>/gguf and reused
    while export_fingerprint holds (a K2-shaped export is 1-6 GB: written into every run dir, a day of peer benchmarks
    filled the disk). A new export replaces the model's older ones of the same type. -> export()'s summary, with
    "reused"."""
    cfg = ctx.cfg
    check_exportable(cfg.model)
    dtype = check_dtype(dtype) if dtype else gguf_dtype(cfg)
    ckpt = Path(resolve_checkpoint(cfg))
    root = cache_dir(cfg) / "gguf"
    stem = ckpt.name if ckpt.name.startswith(f"{cfg.model.name}-") else f"{cfg.model.name}-{ckpt.name}"
    path = root / f"{stem}-{export_fingerprint(cfg, dtype)}-{dtype}.gguf"
    if path.is_file():
        size = path.stat().st_size
        ctx.emit("gguf_reused", checkpoint=str(ckpt), path=str(path), bytes=size)
        print(f"reusing {path} ({dtype.upper()}, {size / 1e6:.1f} MB, exported earlier from {ckpt})")
        return {"path": str(path), "bytes": size, "dtype": dtype, "checkpoint": str(ckpt), "reused": True}
    summary = export(ctx, str(path), dtype=dtype)
    for old in root.glob(f"{stem}-*-{dtype}.gguf"):         # the same model and type, another fingerprint: stale
        if old != path and len(old.name) == len(path.name):
            old.unlink(missing_ok=True)
    return {**summary, "reused": False}


def run(ctx, conf: ExportGgufConfig) -> dict:
    return export(ctx, conf.path)
