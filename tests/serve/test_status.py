"""StatusFile: merged, atomic, readable by another process at any moment."""
import subprocess
import sys
import threading

import pytest

from kdtree.serve.status import StatusFile, read_status


def test_update_merges_and_records_phase_durations(tmp_path):
    st = StatusFile(tmp_path / "status.json")
    first = read_status(tmp_path / "status.json")
    assert first["phase"] == "loading" and first["pid"] > 0 and "updated_at" in first
    st.update(shards_done=1, shards_total=4, bytes_done=100, bytes_total=400, rate_mb_s=1.5, eta_s=2.0)
    st.update(phase="warmup")
    on_disk = read_status(tmp_path / "status.json")
    assert on_disk["shards_done"] == 1 and on_disk["bytes_total"] == 400 and on_disk["phase"] == "warmup"
    assert "seconds" in on_disk["phases"]["loading"] and "started_at" in on_disk["phases"]["warmup"]
    assert on_disk == st.snapshot()


def test_unknown_phase_is_refused_with_the_valid_ones(tmp_path):
    st = StatusFile(tmp_path / "status.json")
    with pytest.raises(ValueError, match="loading, warmup, ready"):
        st.update(phase="booting")


def test_a_reader_never_sees_a_partial_file(tmp_path):
    path = tmp_path / "status.json"
    st = StatusFile(path)
    stop = threading.Event()

    def writer():
        i = 0
        while not stop.is_set():
            st.update(bytes_done=i, blob="x" * 5000)
            i += 1

    t = threading.Thread(target=writer)
    t.start()
    try:
        reader = ("import json,sys\nfor _ in range(300): json.load(open(sys.argv[1]))\nprint('ok')")
        out = subprocess.run([sys.executable, "-c", reader, str(path)], capture_output=True, text=True, timeout=30)
    finally:
        stop.set()
        t.join()
    assert out.stdout.strip() == "ok", out.stderr
