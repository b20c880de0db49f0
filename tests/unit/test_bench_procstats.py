"""bk.bench.procstats: CPU and context switches per entry from /proc, for this
process's threads and a child process (real ones, nothing simulated)."""

import os
import subprocess
import sys
import threading
import time

from bk.bench import procstats


def _burn(seconds: float, burnt: threading.Event, done: threading.Event) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass
    r, w = os.pipe()
    for _ in range(2000):               # 2 write and 2 read syscalls per entry
        os.write(w, b"x")
        os.read(r, 1)
    os.close(r)
    os.close(w)
    burnt.set()
    done.wait(30)          # alive (and named) until the second snapshot


def test_cpu_of_a_named_thread_and_a_child_per_entry():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        burnt, done = threading.Event(), threading.Event()
        t = threading.Thread(target=_burn, args=(0.3, burnt, done), name="bk-io")
        before = procstats.snapshot()
        t.start()
        assert burnt.wait(60)
        after = procstats.snapshot()
        done.set()
        t.join()
    finally:
        child.kill()
        child.wait()
    res = procstats.per_entry(before, after, 1000)
    # 0.3 s of one thread's CPU over 1000 entries: about 300 us each (clock ticks: +-10 ms)
    io = res["per_entry"]["client/bk-io"]
    assert 250 <= io["cpu_us"] <= 400, res
    assert io["wr"] >= 2.0 and io["rd"] >= 2.0, io
    assert res["cpu_us_total"] >= io["cpu_us"]
    assert "other/main" in res["per_entry"]            # the child, neither bookie nor etcd
    assert 0.0 < res["machine_busy"] <= 1.0
