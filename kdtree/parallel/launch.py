"""Start tp.size ranks for the engine process: rank 0 is this process, ranks 1..N-1 are child processes.

    model, stats = launch_tp(cfg, checkpoint, ops, progress)   # -> TPModel (kdtree/parallel/model.py), LoadStats
    ...
    model.close()

Steps: a TCPStore on tp.master_addr:tp.master_port (0 = a free port, bound by the store itself, no race);
children `python -m kdtree.parallel.worker` in OUR process group (killpg of the engine stops them too), each
with one end of a socketpair for commands; every rank joins the default process group (gloo, or nccl for
backend=cuda with one GPU per rank through CUDA_VISIBLE_DEVICES); all ranks read only their slices
(kdtree/parallel/sharding.py) at the same time; build_target (NativeTarget or K2Model) on every rank with the
rank-ordered all-reduce (kdtree/parallel/comm.py). Workers die with rank 0 (PR_SET_PDEATHSIG, socket EOF, collective timeout
tp.timeout_s); close() and interpreter exit shut them down cleanly.

Caveat: PR_SET_PDEATHSIG fires when the THREAD that started the workers exits, so launch from a long-lived
thread (the engine's main thread does).
"""
from __future__ import annotations

import atexit
import datetime
import os
import signal
import socket
import subprocess
import sys
import time
import weakref
from dataclasses import replace
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import List, Optional, Tuple

from kdtree.checkpoint.loader import load_checkpoint, load_options, resident_bytes
from kdtree.config.validate import validate_tp
from kdtree.errors import ConfigError
from kdtree.backends.native_forward import keeps_bf16
from kdtree.model.target import build_target
from kdtree.parallel.comm import init_group, leave_group, ordered_all_reduce, resolve_collective, resolve_dist_backend
from kdtree.parallel.model import TPError, TPModel
from kdtree.parallel.sharding import shard_fn

DEFAULT_TIMEOUT_S = 300.0     # collectives and rendezvous; a rank silent this long is treated as dead
REPO_DIR = Path(__file__).resolve().parents[2]
_LIVE: "weakref.WeakSet[TPModel]" = weakref.WeakSet()


class _Worker:
    """Rank r's child process and rank 0's end of its command socket."""

    def __init__(self, rank: int, proc: subprocess.Popen, conn: Connection):
        self.rank, self.proc, self.conn = rank, proc, conn
        self._words: Optional[str] = None

    def last_words(self) -> str:
        """The worker's ("error", msg) if it sent one, or how it exited; '' while it is alive and silent."""
        try:
            while self._words is None and self.conn.poll(0):
                msg = self.conn.recv()
                if msg[0] == "error":
                    self._words = msg[1]
        except (EOFError, OSError):
            pass
        if self._words:
            return self._words
        if self.proc.poll() is not None:
            return f"process {self.proc.pid} exited with code {self.proc.returncode} (its stderr is in the engine log)"
        return ""

    def stop(self, timeout_s: float) -> None:
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=timeout_s)
        self.conn.close()


def _timeout_s(cfg) -> float:
    return float(cfg.tp.get("timeout_s", DEFAULT_TIMEOUT_S) or DEFAULT_TIMEOUT_S)


def _worker_env(rank: int, tp: int, dist_backend: str) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_DIR)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):  # N ranks share this host's cores
        env.setdefault(var, str(max(1, (os.cpu_count() or 1) // tp)))
    if dist_backend == "nccl":  # rank r sees only its GPU as cuda:0 (rank 0 uses cuda:0 of this process)
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
        ids = [d for d in visible.split(",") if d] if visible else [str(i) for i in range(tp)]
        if len(ids) < tp:
            raise ConfigError(f"tp={tp} with backend=cuda needs {tp} GPUs but CUDA_VISIBLE_DEVICES={visible} lists "
                              f"{len(ids)}; use tp={len(ids)} or expose more GPUs")
        env["CUDA_VISIBLE_DEVICES"] = ids[rank]
    return env


def _await(workers: List[_Worker], want: str, timeout_s: Optional[float]) -> List[dict]:
    """Wait for message `want` from every worker; a worker's error or exit raises TPError at once."""
    got = {}
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while len(got) < len(workers):
        pending = [w for w in workers if w.rank not in got]
        ready = wait([w.conn for w in pending], timeout=0.5)
        for w in pending:
            if w.conn in ready:
                try:
                    msg = w.conn.recv()
                except (EOFError, OSError):
                    msg = ("error", w.last_words() or "closed its command socket")
                if msg[0] == "error":
                    raise TPError(f"tp rank {w.rank}/{len(workers) + 1} failed before {want}: {msg[1]}")
                if msg[0] == want:
                    got[w.rank] = msg[1] if len(msg) > 1 else {}
            elif w.proc.poll() is not None:
                raise TPError(f"tp rank {w.rank}/{len(workers) + 1} exited with code {w.proc.returncode} before "
                              f"{want} (its stderr is in the engine log)")
        if deadline is not None and time.monotonic() > deadline:
            late = sorted(set(w.rank for w in workers) - set(got))
            raise TPError(f"tp ranks {late} sent no '{want}' within {timeout_s:.0f} s (tp.timeout_s); "
                          f"check the engine log, or raise tp.timeout_s on a slow host")
    return [got[w.rank] for w in workers]


def exit_words(code: int) -> str:
    """'exit code 3' / 'killed by SIGKILL' for a Popen returncode."""
    if code is not None and code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def _watched(progress, workers: List[_Worker], tp: int, every_s: float = 0.2):
    """progress(...) that first checks the other ranks (at most every `every_s`): rank 0 loads its own slices
    for minutes while ranks 1..N-1 load theirs; a rank that dies meanwhile fails the load at once (TPError
    naming it and its exit status, which the load stage writes to status.json), not when rank 0 is done."""
    last = [0.0]

    def check() -> None:
        now = time.monotonic()
        if now - last[0] < every_s:
            return
        last[0] = now
        for w in workers:
            code = w.proc.poll()
            if code is not None:
                words = w.last_words()
                raise TPError(f"tp rank {w.rank}/{tp} (pid {w.proc.pid}) exited during load, {exit_words(code)}"
                              + (f": {words}" if words and "exited with code" not in words else "")
                              + "; see the engine log")

    def wrapped(*args):
        check()
        if progress is not None:
            progress(*args)

    return wrapped


def launch_tp(cfg, checkpoint, ops, progress=None) -> Tuple[TPModel, object]:
    """Start ranks 1..N-1, load rank 0's slices here -> (TPModel, rank 0's LoadStats with bytes_read of ALL ranks)."""
    import torch.distributed as dist
    from omegaconf import OmegaConf

    validate_tp(cfg)
    tp = int(cfg.tp.size)
    if dist.is_initialized():
        raise ConfigError(f"tp={tp}: this process already belongs to a torch.distributed group (another "
                          f"tensor-parallel engine?); close() that engine first")
    dist_backend = resolve_dist_backend(cfg.tp, str(cfg.backend.name))
    timeout_s = _timeout_s(cfg)
    store = dist.TCPStore(str(cfg.tp.master_addr), int(cfg.tp.master_port), None, True,
                          timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False)
    setup = {
        "cfg": {k: OmegaConf.to_container(cfg[k], resolve=True) for k in ("model", "quant", "backend", "load", "tp")},
        "checkpoint": str(checkpoint), "master_addr": str(cfg.tp.master_addr), "master_port": int(store.port),
        "dist_backend": dist_backend, "timeout_s": timeout_s,
    }
    workers: List[_Worker] = []
    model: Optional[TPModel] = None
    try:
        for rank in range(1, tp):
            ours, theirs = socket.socketpair()
            proc = subprocess.Popen([sys.executable, "-m", "kdtree.parallel.worker", str(rank), str(tp),
                                     str(theirs.fileno()), str(os.getpid())],
                                    pass_fds=(theirs.fileno(),), env=_worker_env(rank, tp, dist_backend),
                                    stdin=subprocess.DEVNULL)
            theirs.close()
            conn = Connection(ours.detach())
            workers.append(_Worker(rank, proc, conn))
            conn.send(("setup", setup))
        _await(workers, "joined", timeout_s)           # every rank is up and about to join the group
        init_group(store, 0, tp, dist_backend, timeout_s)
        rss0 = resident_bytes()
        weights, stats = load_checkpoint(checkpoint, cfg.model, cfg.quant, shard=shard_fn(cfg.model, 0, tp),
                                         progress=_watched(progress, workers, tp), bf16=keeps_bf16(ops),
                                         **load_options(cfg.load))
        local = build_target(cfg.model, weights, ops, all_reduce=ordered_all_reduce(
            tp, dist_backend, resolve_collective(cfg.tp, str(cfg.backend.name)),
            strict=str(cfg.tp.get("collective", "auto")) == "nccl"))
        del weights
        rss0 = resident_bytes() - rss0
        ready = _await(workers, "ready", None)         # loading takes as long as it takes; a dead rank raises
        per_rank = [int(stats.bytes_read)] + [int(r["bytes_read"]) for r in ready]
        model = TPModel(local, workers, tp, per_rank, store)
        model.resident_bytes_per_rank = [rss0] + [int(r.get("resident_bytes", 0)) for r in ready]  # load's growth
        _LIVE.add(model)
        model.attach_device_collective()               # backend=cuda: NCCL on the stream, now that all have loaded
        total = sum(per_rank)
        return model, replace(stats, bytes_read=total, mb_s=total / 1e6 / max(stats.seconds, 1e-9))
    except BaseException:
        if model is None:
            for w in workers:
                if w.proc.poll() is None:
                    w.proc.kill()
                w.stop(10.0)
            leave_group()
        else:
            model.close()
        raise


@atexit.register
def _close_live_models() -> None:
    """Interpreter exit: shut the workers down cleanly (they would also die by PDEATHSIG / socket EOF)."""
    for model in list(_LIVE):
        try:
            model.close(timeout_s=5.0)
        except Exception:
            pass
