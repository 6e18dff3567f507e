"""Verdict rules on probe results as the probes return them (no server needed)."""
from __future__ import annotations

from kdtree.monitor.probes import ProbeResult
from kdtree.monitor.verdict import Judge, moved_signals, progress_signals


def loading(bytes_done, cpu_s=1.0, rchar=10 << 20, alive=True, state="S", http=503):
    return {
        "completion": ProbeResult("completion", True, 0.01, data={"http": http, "port": "open", "answered": http == 200,
                                                                 "text": "4" if http == 200 else None}),
        "status": ProbeResult("status", True, 0.01, data={"source": "http", "status": {
            "phase": "loading", "bytes_done": bytes_done, "bytes_total": 100, "shards_done": 0}}),
        "process": ProbeResult("process", True, 0.01, data={"pid": 7, "alive": alive, "state": state, "cpu_s": cpu_s,
                                                            "rchar": rchar, "read_bytes": 0, "io_readable": True}),
    }


def test_moving_bytes_is_progressing_and_silence_is_stalled_after_the_window():
    j = Judge(stall_window_s=10, deadline_s=600, now=0.0)
    v = j.judge(loading(10), 0.0)            # nothing to compare with yet: no claim of progress
    assert v.verdict == "WAITING" and "nothing moved yet" in v.reason and not v.terminal
    v = j.judge(loading(20), 1.0)
    assert v.verdict == "PROGRESSING" and "status.bytes_done" in v.moved
    for t in range(2, 11):                       # frozen: nothing moves for 9 s of a 10 s window
        v = j.judge(loading(20), float(t))
        assert v.verdict == "PROGRESSING" and not v.moved and not v.terminal
    v = j.judge(loading(20), 11.0)
    assert v.verdict == "STALLED" and v.terminal and "nothing moved for 10 s" in v.reason



def test_a_move_is_timed_when_the_probes_read_it_not_when_a_slow_sample_ended():
    """Over ssh (or with curl waiting on a frozen server) a sample lasts seconds: the window counts from the
    start of the sample that saw the last move, and a sample that saw a move is never STALLED."""
    j = Judge(stall_window_s=4, deadline_s=600, now=0.0)
    j.judge(loading(10), 1.0, seen_at=0.0)
    v = j.judge(loading(20), 6.0, seen_at=3.0)       # a 3 s sample that saw bytes move: not quiet, not STALLED
    assert v.verdict == "PROGRESSING" and v.quiet_s == 0.0 and v.moved
    v = j.judge(loading(20), 6.9, seen_at=6.0)
    assert v.verdict == "PROGRESSING" and abs(v.quiet_s - 3.9) < 1e-9
    v = j.judge(loading(20), 7.0, seen_at=6.9)       # 4 s after the moving sample started, not after it ended
    assert v.verdict == "STALLED" and v.terminal
    slow = Judge(stall_window_s=2, deadline_s=600, now=0.0)
    slow.judge(loading(10), 0.5, seen_at=0.0)
    assert slow.judge(loading(20), 5.0, seen_at=0.5).verdict == "PROGRESSING"   # a sample > the window

def test_the_monitors_own_probes_do_not_count_as_progress():
    """Answering the probes costs the server a few ms of CPU: below the floor, so a hung load still stalls."""
    assert moved_signals({"process.cpu_s": 1.0}, {"process.cpu_s": 1.01}, dt=1.0) == []
    assert moved_signals({"process.cpu_s": 1.0}, {"process.cpu_s": 1.5}, dt=1.0) == ["process.cpu_s"]
    assert moved_signals({"process.rchar": 0}, {"process.rchar": 4096}, dt=1.0) == []


def test_machine_wide_disk_reads_never_count_only_the_named_disk_does():
    probes = loading(20)
    probes["disk"] = ProbeResult("disk", True, 0.01, data={"devices": {"sda": {"read_bytes": 1 << 30}}})
    assert "disk.read_bytes" not in progress_signals(probes)       # the process is known: its own reads count
    del probes["process"]
    assert "disk.read_bytes" not in progress_signals(probes)       # nor without one: another process may read
    probes["disk"].data["named_read_bytes"] = 1 << 30              # health.disk=sda: the operator says it is ours
    assert progress_signals(probes)["disk.read_bytes"] == 1 << 30


def url_only(port="refused", http=None, code_final=False, message=""):
    data = {"http": http, "port": port, "answered": False, "detail": "Failed to connect"}
    if http is not None:
        data.update(final=code_final, message=message)
    return {"completion": ProbeResult("completion", True, 0.01, data=data),
            "status": ProbeResult("status", True, 0.01, data={"source": None, "status": None}),
            "disk": ProbeResult("disk", True, 0.01, data={"devices": {}})}


def test_nothing_listening_for_the_window_is_unreachable_with_the_reason():
    j = Judge(stall_window_s=3, deadline_s=600, now=0.0)
    for t in (0.0, 1.0, 2.0):
        assert j.judge(url_only(), t).verdict == "WAITING"
    v = j.judge(url_only(), 3.0)
    assert v.verdict == "UNREACHABLE" and v.terminal and "connection refused" in v.reason
    v = Judge(3, 600, 0.0).judge(url_only("unresolved"), 3.5)
    assert v.verdict == "UNREACHABLE" and "not resolved" in v.reason
    # a server that listens but never gets ready is STALLED, not UNREACHABLE
    j = Judge(stall_window_s=3, deadline_s=600, now=0.0)
    assert j.judge(url_only("open", http=503), 3.5).verdict == "STALLED"


def test_a_permanent_4xx_is_its_own_verdict_after_two_samples():
    j = Judge(stall_window_s=30, deadline_s=600, now=0.0)
    assert j.judge(url_only("open", http=404, code_final=False), 0.0).verdict == "WAITING"  # model unsettled
    assert j.judge(url_only("open", http=404, code_final=True, message="Not Found"), 1.0).verdict == "WAITING"
    v = j.judge(url_only("open", http=404, code_final=True, message="Not Found"), 2.0)
    assert v.verdict == "NOT_OPENAI" and v.terminal and "HTTP 404 'Not Found'" in v.reason
    assert "not as an OpenAI completions server" in v.reason


def test_a_process_leaving_the_tree_is_noted_not_subtracted():
    from kdtree.monitor.probes import ProcessTree

    tree = ProcessTree()
    def proc(pid, rb, cpu):
        return {"pid": pid, "state": "R", "start": pid, "read_bytes": rb, "rchar": 0, "cpu_s": cpu, "faults": 0}
    a = {"pid": 1, "procs": {1: proc(1, 100, 1.0), 2: proc(2, 5000, 9.0)}}
    tree.account(a)
    b = {"pid": 1, "procs": {1: proc(1, 200, 1.5), 3: proc(3, 300, 0.5)}}     # rank 2 died, worker 3 appeared
    tree.account(b)
    assert b["left"] == [2] and b["members"] == [1, 3]
    assert b["read_bytes"] - a["read_bytes"] == 100 + 300 and b["cpu_s"] - a["cpu_s"] == 1.0   # never negative


def test_gone_or_zombie_process_is_crashed_and_ready_wins():
    j = Judge(10, 600, 0.0)
    v = j.judge(loading(10, alive=False, state="gone"), 0.0)
    assert v.verdict == "CRASHED" and v.terminal and "pid 7 is gone" in v.reason
    v = Judge(10, 600, 0.0).judge(loading(10, alive=False, state="Z"), 0.0)
    assert v.verdict == "CRASHED" and "not reaped" in v.reason
    v = Judge(10, 600, 0.0).judge(loading(100, http=200), 0.0)
    assert v.verdict == "READY" and v.terminal


def test_unreachable_host_is_called_after_the_window_not_on_one_blip():
    down = {n: ProbeResult(n, False, 5.0, unreachable=True, error="ssh: connection refused") for n in ("completion", "disk")}
    j = Judge(stall_window_s=3, deadline_s=600, now=0.0)
    v = j.judge(down, 0.0)
    assert v.verdict == "UNREACHABLE" and not v.terminal
    assert j.judge(loading(10), 1.0).verdict == "WAITING"           # back: the clock restarts
    assert not j.judge(down, 2.0).terminal
    v = j.judge(down, 5.5)
    assert v.verdict == "UNREACHABLE" and v.terminal


def test_a_late_sample_is_slow_not_unreachable_and_a_stopped_process_is_named():
    late = {n: ProbeResult(n, False, 21.0, timed_out=True, error="command timed out after 21 s on local")
            for n in ("completion", "disk")}
    j = Judge(stall_window_s=30, deadline_s=600, now=0.0, local=True)
    j.judge(loading(10), 0.0)
    j.judge(loading(20), 1.0)
    v = j.judge(late, 22.0, seen_at=1.0)                 # a local host: a slow sample, never "unreachable"
    assert v.verdict == "WAITING" and "slow sample" in v.reason and "unreachable" not in v.reason and not v.terminal
    v = j.judge(late, 31.5, seen_at=22.0)
    assert v.verdict == "STALLED" and v.terminal and "unreachable" not in v.reason
    ssh = Judge(stall_window_s=30, deadline_s=600, now=0.0)
    v = ssh.judge({n: ProbeResult(n, False, 2.0, timed_out=True, error="no answer for 2 s") for n in ("completion",)},
                  2.0, seen_at=0.0)                      # ssh slower than usual: not (yet) unreachable
    assert v.verdict == "WAITING" and "unreachable" not in v.reason and "not answering for 2 s" in v.reason
    frozen = Judge(stall_window_s=3, deadline_s=600, now=0.0)
    for t in (0.0, 1.0, 2.0):
        assert frozen.judge(loading(10, state="T"), t).verdict == "WAITING"
    v = frozen.judge(loading(10, state="T"), 3.0)
    assert v.verdict == "STALLED" and "pid 7 is stopped (state T" in v.reason


def test_deadline_extends_while_progress_moves():
    j = Judge(stall_window_s=5, deadline_s=3, now=0.0)
    for t in range(0, 20):                       # bytes move every second: never a failure
        v = j.judge(loading(t), float(t))
        assert v.verdict == ("WAITING" if t == 0 else "PROGRESSING"), (t, v)


def test_one_sample_script_output_parses_into_every_probe():
    """parse_sample on the script's section format (nvidia-smi's CSV as `--format=csv,noheader,nounits` prints it;
    no GPU on CI machines, so the GPU section is text here)."""
    from kdtree.monitor.probes import SampleSpec, parse_sample

    spec = SampleSpec(url="http://127.0.0.1:1", model="m", pid=10, log="/x.log")
    out = ("@@kd process 100.0\npid 10\n500.0 1.0\n100\n"
           "## 10\n10 (python3 -m (sglang)) S 1 10 10 0 -1 0 300 0 7 0 250 50 0 0 20 0 1 0 1000 0 0\n"
           "VmRSS:\t  2048 kB\nrchar: 5000\nread_bytes: 8192\n"
           "## 11\n11 (worker) R 10 11 11 0 -1 0 10 0 0 0 100 0 0 0 20 0 1 0 2000 0 0\nrchar: 1\nread_bytes: 4096\n"
           "@@kd disk 100.1\n 259 0 nvme0n1 10 0 2048 0 0 0 16 0\n"
           "@@kd gpu 100.2\n0, GPU-aaa, 40960, 143771, 87\n1, GPU-bbb, 0, 143771, 0\n@@apps\n11, GPU-aaa, 40000\n"
           "@@kd log 100.3\n123 1700000000\nloading\n@@kd wait 100.4\n"
           "@@http completion\n0 100.0 100.5\n503 0.001\n\n{\"error\": {\"message\": \"loading 3/8\"}}\n"
           "@@http status\n7 100.0 100.0\n000 0.000000\ncurl: (7) Failed to connect\n\n@@kd end 100.6\n")
    p = parse_sample(spec, out, 0.7)
    assert p["completion"].data == {"http": 503, "port": "open", "answered": False, "message": "loading 3/8"}
    proc = p["process"].data
    assert proc["alive"] and proc["state"] == "S" and set(proc["procs"]) == {10, 11}
    assert proc["procs"][10]["cpu_s"] == 3.0 and proc["procs"][10]["faults"] == 307     # (250+50)/100, 300+7
    assert proc["procs"][11]["read_bytes"] == 4096 and proc["procs"][10]["rss_bytes"] == 2048 * 1024
    assert p["disk"].data["devices"]["nvme0n1"]["read_bytes"] == 2048 * 512
    assert p["gpu"].data["apps"] == [{"pid": 11, "uuid": "GPU-aaa", "mem_mb": 40000.0}]
    assert p["log"].data["size"] == 123 and abs(p["disk"].seconds - 0.1) < 1e-6
    assert p["status"].data["source"] is None


def test_the_completion_answer_moving_towards_ready_is_progress_and_freezing_is_not():
    def state(v):
        return {"completion.state": v}
    assert moved_signals(state("closed"), state("503"), 1.0) == ["completion.state"]      # the port opened
    assert moved_signals(state("closed"), state("slow"), 1.0) == ["completion.state"]
    assert moved_signals(state("503"), state("404"), 1.0) == ["completion.state"]
    assert moved_signals(state("503"), state("slow"), 1.0) == []          # a frozen server stops answering
    assert moved_signals(state("503"), state("closed"), 1.0) == []
