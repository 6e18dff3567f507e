"""A tensor-parallel rank 1..N-1: join the group, load this rank's slices, then run rank 0's commands.

Started by kdtree/parallel/launch.py (never by hand):
    python -m kdtree.parallel.worker RANK WORLD FD PARENT_PID

FD is this rank's end of a socketpair with rank 0 (a multiprocessing Connection carrying pickled tuples):
    rank 0 -> worker  ("setup", {...}) once, then (op, args) per command:
                      forward(pages, length, tokens, positions, visibility, hidden_layers),
                      forward_batch([(pages, length, tokens, positions, visibility)], hidden_layers),
                      keep(pages, start, rows), pages(n_pages, page_rows), attach_device_collective(), shutdown()
                      (a cache is rank 0's page table + length: this rank's arena, sized as rank 0's pool, has the
                      same page ids)
    worker -> rank 0  ("joined",) before init_process_group, ("ready", {bytes_read, seconds, resident_bytes}) after loading,
                      ("error", "one line") before exiting 1 on any failure
The worker exits when rank 0 dies: PR_SET_PDEATHSIG (SIGKILL when the launching thread's process goes), EOF on
the socket while idle, and a peer-closed / timed-out collective in a forward. SIGINT is ignored (a terminal's
Ctrl-C reaches the whole process group; rank 0 decides).
"""
from __future__ import annotations

import ctypes
import datetime
import os
import signal
import sys
import time
from multiprocessing.connection import Connection

from kdtree.backends import get_ops
from kdtree.checkpoint.loader import load_checkpoint, load_options, resident_bytes
from kdtree.backends.native_forward import keeps_bf16
from kdtree.model.pages import PageView
from kdtree.model.target import build_target
from kdtree.parallel.comm import init_group, ordered_all_reduce, resolve_collective
from kdtree.parallel.sharding import shard_fn

PR_SET_PDEATHSIG = 1


def _die_with_parent(parent_pid: int) -> None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: the socket EOF and collective timeouts still end us
        pass
    if os.getppid() != parent_pid:     # rank 0 died before prctl took effect
        os._exit(1)


def _serve(conn: Connection, rank: int, world: int) -> None:
    import torch
    from omegaconf import OmegaConf

    op, setup = conn.recv()
    assert op == "setup", op
    cfg = OmegaConf.create(setup["cfg"])
    torch.set_num_threads(1)  # torch only gathers and adds the partials here
    import torch.distributed as dist

    store = dist.TCPStore(setup["master_addr"], setup["master_port"], world, False,
                          timeout=datetime.timedelta(seconds=setup["timeout_s"]))
    conn.send(("joined",))
    init_group(store, rank, world, setup["dist_backend"], setup["timeout_s"])

    t0 = time.monotonic()
    ops = get_ops(cfg.backend)
    rss0 = resident_bytes()
    weights, stats = load_checkpoint(setup["checkpoint"], cfg.model, cfg.quant, shard=shard_fn(cfg.model, rank, world),
                                     bf16=keeps_bf16(ops), **load_options(cfg.load))
    collective = resolve_collective(cfg.tp, str(cfg.backend.name))
    model = build_target(cfg.model, weights, ops, all_reduce=ordered_all_reduce(
        world, setup["dist_backend"], collective, strict=str(cfg.tp.get("collective", "auto")) == "nccl"))
    del weights
    # rank 0 alone turns the last hidden state into logits (accept, drafter); skip lm_head's GEMV here
    model.return_logits = False
    conn.send(("ready", {"bytes_read": int(stats.bytes_read), "seconds": time.monotonic() - t0,
                         "resident_bytes": resident_bytes() - rss0}))

    while True:
        try:
            op, args = conn.recv()
        except EOFError:               # rank 0 is gone
            return
        P = model.pages.page_rows
        if op == "forward":
            pages, length, tokens, positions, visibility, hidden_layers = args
            model.forward(tokens, positions, PageView(pages, length, P), visibility=visibility,
                          hidden_layers=hidden_layers)
        elif op == "forward_batch":
            seqs, hidden_layers = args
            model.forward_batch([(t, p, PageView(pages, n, P), v) for pages, n, t, p, v in seqs],
                                hidden_layers=hidden_layers)
        elif op == "keep":                         # tree compaction within a sequence's pages
            pages, start, rows = args
            model.move_rows(pages, start, rows)
        elif op == "pages":                        # rank 0's pool changed size: this arena follows
            n_pages, page_rows = args
            model.pages.reserve(n_pages, page_rows)
        elif op == "attach_device_collective":     # every rank has loaded (see TPModel.attach_device_collective)
            model.attach_device_collective()
        elif op == "shutdown":
            return
        else:
            raise ValueError(f"unknown command {op!r} from rank 0")


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    rank, world, fd, parent = (int(a) for a in argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _die_with_parent(parent)
    conn = Connection(fd)
    try:
        _serve(conn, rank, world)
    except BaseException as e:  # report one line to rank 0, then exit non-zero
        msg = f"{type(e).__name__}: {e}".splitlines()[0] if str(e) else type(e).__name__
        try:
            conn.send(("error", msg))
        except OSError:
            pass
        print(f"kdtree tp rank {rank}/{world}: {msg}", file=sys.stderr, flush=True)
        return 1
    finally:
        try:
            import torch.distributed as dist
            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:
            pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
