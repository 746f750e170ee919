import csv
import hashlib
import json
import socket
import subprocess
import sys
import threading
import time

import pytest

from hybriddl.monitoring.monitor import PIDSTAT_COLUMNS, SAR_COLUMNS, Monitor
from hybriddl.rundir import METRICS

INTERVAL = 0.1


def read_rows(path, columns):
    with open(path, newline="") as handle:
        rows = list(csv.reader(handle))
    assert tuple(rows[0]) == columns
    assert all(len(row) == len(columns) for row in rows[1:])
    return [dict(zip(columns, row)) for row in rows[1:]]


def busy_for(cpu_seconds: float) -> None:
    """Pure-Python work until this thread has used cpu_seconds of CPU."""
    end = time.thread_time() + cpu_seconds
    x = 0
    while time.thread_time() < end:
        for i in range(20000):
            x += i * i


def busy_outside_the_gil(seconds: float) -> None:
    """CPU work in C that releases the GIL (as torch's kernels do), for `seconds`."""
    data = b"\0" * (1 << 22)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        hashlib.sha256(data).digest()


def monitored(tmp_path, work, interval=INTERVAL):
    with Monitor(tmp_path, rank=3, interval=interval) as monitor:
        started = time.perf_counter()
        work()
        duration = time.perf_counter() - started
    return monitor.summary(), duration


def test_samples_cover_the_run_in_well_formed_csvs(tmp_path):
    # Pure-Python work would starve the sampler of the GIL (a convoy), training does not.
    summary, duration = monitored(tmp_path, lambda: busy_outside_the_gil(0.6))
    pidstat = read_rows(tmp_path / "rank3-pidstat.csv", PIDSTAT_COLUMNS)
    sar = read_rows(tmp_path / "rank3-sar.csv", SAR_COLUMNS)

    expected = duration / INTERVAL
    assert 0.5 * expected <= len(pidstat) <= expected + 2
    assert summary["samples"] == len(pidstat)
    elapsed = [float(row["elapsed_s"]) for row in pidstat]
    assert elapsed == sorted(elapsed) and len(set(elapsed)) == len(elapsed)
    # Every sampled interval together spans the run: no gap, no overlap.
    assert sum(float(row["interval_s"]) for row in pidstat) == pytest.approx(elapsed[-1], abs=0.01)
    assert elapsed[-1] >= duration - 0.01
    # The sampler thread counts itself, but in the tail's sample, taken once it has
    # stopped (a tail longer than a tenth of an interval: on a loaded machine).
    assert all(int(row["threads"]) >= 2 for row in pidstat[:-1])
    for row in pidstat:
        assert float(row["rss_mib"]) > 1 and int(row["threads"]) >= 1 and int(row["processes"]) >= 1
        assert float(row["cpu_total_pct"]) == pytest.approx(
            float(row["cpu_user_pct"]) + float(row["cpu_system_pct"]), abs=0.11)

    interfaces = {row["interface"] for row in sar}
    assert "lo" in interfaces
    assert len(sar) == len(pidstat) * len(interfaces)  # long format: a row per interface per sample
    for row in sar:
        assert 0 <= float(row["cpu_idle_pct"]) <= 100 and 0 < float(row["memory_used_pct"]) < 100


def test_busy_loop_shows_far_more_cpu_than_sleep(tmp_path):
    busy, _ = monitored(tmp_path / "busy", lambda: busy_for(1.0))
    idle, _ = monitored(tmp_path / "idle", lambda: time.sleep(1.0))

    def cpu_seconds(summary):
        return summary["process"]["cpu_avg_pct"] / 100 * summary["duration_s"]

    # Accounting first, whatever the machine's load: the loop burned 1 s of CPU (the
    # kernel counts in 10 ms ticks); the sleeper only the sampler's few ms per sample.
    assert cpu_seconds(busy) >= 0.95
    assert cpu_seconds(idle) < 0.3
    assert busy["process"]["cpu_avg_pct"] > 2 * idle["process"]["cpu_avg_pct"]
    assert busy["process"]["cpu_peak_pct"] > idle["process"]["cpu_peak_pct"]


def test_children_cpu_counts_toward_the_training_process(tmp_path):
    code = ("import time\nend = time.process_time() + 0.5\n"
            "while time.process_time() < end:\n    sum(i * i for i in range(10000))\n")

    def child_work():
        subprocess.run([sys.executable, "-c", code], check=True, timeout=120)

    summary, _ = monitored(tmp_path, child_work)
    assert summary["process"]["processes_peak"] >= 2
    rows = read_rows(tmp_path / "rank3-pidstat.csv", PIDSTAT_COLUMNS)
    assert max(int(row["processes"]) for row in rows) >= 2
    # The parent only waits; the child's CPU must be what the tree shows.
    assert summary["process"]["cpu_avg_pct"] > 15


def test_loopback_bytes_show_up_in_lo_totals(tmp_path):
    payload = b"\x00" * (20 * 1024 * 1024)
    received = []

    def transfer():
        server = socket.create_server(("127.0.0.1", 0))
        with server, socket.create_connection(server.getsockname()) as sender:
            connection, _ = server.accept()

            def drain():
                total = 0
                with connection:
                    while chunk := connection.recv(1 << 20):
                        total += len(chunk)
                received.append(total)

            reader = threading.Thread(target=drain)
            reader.start()
            sender.sendall(payload)
            sender.shutdown(socket.SHUT_WR)
            reader.join()

    summary, _ = monitored(tmp_path, transfer)
    assert received == [len(payload)]
    assert "lo" in summary["network"], summary  # a sample failed: the summary says why
    lo = summary["network"]["lo"]
    assert lo["tx_bytes"] >= len(payload) and lo["rx_bytes"] >= len(payload)
    # The CSV's rates, times their intervals, add up to the same bytes.
    rows = [row for row in read_rows(tmp_path / "rank3-sar.csv", SAR_COLUMNS) if row["interface"] == "lo"]
    sent = sum(float(row["tx_bytes_per_s"]) * float(row["interval_s"]) for row in rows)
    assert sent == pytest.approx(lo["tx_bytes"], rel=0.05)  # rates and intervals are rounded in the CSV


def test_rows_reach_the_file_while_the_monitor_runs(tmp_path):
    path = tmp_path / "rank3-pidstat.csv"
    with Monitor(tmp_path, rank=3, interval=0.05):
        deadline = time.monotonic() + 30
        lines = 0
        while lines < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
            lines = len(path.read_text().splitlines())
        assert lines >= 3  # header + 2 samples, before stop(): an interrupted run keeps them


def test_sampler_thread_ends_with_the_block_even_on_error(tmp_path):
    with pytest.raises(RuntimeError):
        with Monitor(tmp_path, rank=0, interval=INTERVAL):
            raise RuntimeError("training failed")
    assert not [t for t in threading.enumerate() if t.name.startswith("hybriddl-monitor")]
    assert (tmp_path / "rank0-pidstat.csv").read_text().startswith("timestamp_unix_s,")


def test_rows_a_full_disk_refused_do_not_hide_the_runs_own_error(tmp_path):
    """The rows a full disk refused are still buffered when the files close, so closing
    fails too: that must not replace the run's own error (a one-line StorageError) with a
    traceback, nor leave the monitor half stopped."""
    import os

    with pytest.raises(RuntimeError, match="the run's own error"):
        with Monitor(tmp_path, rank=0, interval=INTERVAL) as monitor:
            full = os.open("/dev/full", os.O_WRONLY)  # every write: ENOSPC
            for handle in monitor._files:
                os.dup2(full, handle.fileno())
            os.close(full)
            raise RuntimeError("the run's own error")
    assert "No space left" in monitor.summary()["error"]
    assert monitor.stop() is monitor.summary()  # stopped: nothing left to close
    assert not [t for t in threading.enumerate() if t.name.startswith("hybriddl-monitor")]


def test_a_file_that_cannot_be_opened_leaves_none_open(tmp_path):
    """The sar file refused (here: a folder in its place) after the pidstat file opened:
    start() fails with that error and closes what it had opened (stop() had nothing to
    close, so the handle leaked), and a later start opens both afresh."""
    monitor = Monitor(tmp_path, rank=0, interval=INTERVAL)
    monitor.sar_path.mkdir()
    with pytest.raises(IsADirectoryError):
        monitor.start()
    assert monitor._files == [] and monitor._thread is None
    assert not [t for t in threading.enumerate() if t.name.startswith("hybriddl-monitor")]
    monitor.sar_path.rmdir()
    with monitor:
        pass
    assert len(monitor._files) == 0 and monitor.sar_path.read_text().startswith("timestamp")


def test_a_resumed_run_appends_after_the_row_a_cut_cut_short(tmp_path):
    """A row cut short (a full disk, a kill) ends the file without its newline: the resumed
    run's rows start on a line of their own, so every row stays whole and `report` reads
    the file; a file with not one whole line starts again with its header."""
    path = tmp_path / "rank0-pidstat.csv"
    with Monitor(tmp_path, rank=0, interval=INTERVAL):
        pass
    whole = path.read_text()
    path.write_text(whole + "1764540000.5,12")  # the next row, cut short
    with Monitor(tmp_path, rank=0, interval=INTERVAL):
        pass
    rows = read_rows(path, PIDSTAT_COLUMNS)
    assert len(rows) >= 2 and path.read_text().startswith(whole)
    path.write_text("timestamp_unix_s,p")  # the header itself cut short
    with Monitor(tmp_path, rank=0, interval=INTERVAL):
        pass
    assert len(read_rows(path, PIDSTAT_COLUMNS)) >= 1


def test_interval_zero_disables_monitoring(tmp_path):
    with Monitor(tmp_path / "run", rank=0, interval=0) as monitor:
        assert not [t for t in threading.enumerate() if t.name.startswith("hybriddl-monitor")]
    assert monitor.summary() is None
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_monitored_train_run_records_files_summary_and_epoch_times(cli, tmp_path):
    run_dir = tmp_path / "run"
    done = cli("train", "--model", "resnet18", "--image-size", "32", "--batch-size", "8",
               "--max-steps", "2", "--monitor-interval", "0.1", "--strategy", "sequential",
               "--run-dir", str(run_dir))
    assert done.returncode == 0, done.stderr
    metrics = json.loads((run_dir / METRICS).read_text())
    monitor = metrics["monitor"]
    assert monitor["files"] == {"pidstat": "rank0-pidstat.csv", "sar": "rank0-sar.csv"}
    rows = read_rows(run_dir / "rank0-pidstat.csv", PIDSTAT_COLUMNS)
    assert len(rows) == monitor["samples"] >= 1
    assert monitor["process"]["rss_peak_bytes"] > 10 * 2**20
    assert "lo" in monitor["network"]
    epoch = metrics["epochs"][0]
    assert monitor["started_at"] <= epoch["started_at"] < epoch["ended_at"]
    assert epoch["ended_at"] <= monitor["started_at"] + monitor["duration_s"]


def test_negative_monitor_interval_is_refused(tmp_path, capsys):
    from hybriddl.cli import main

    assert main(["train", "--monitor-interval", "-1", "--run-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert "--monitor-interval -1" in err and "Traceback" not in err
    assert not (tmp_path / "run").exists()


def test_training_that_fails_still_stops_its_monitor(tmp_path):
    from hybriddl.run import trainer
    from hybriddl.run.settings import TrainConfig

    class FailingObserver(trainer.TrainingObserver):
        def on_step(self, epoch, step, samples, seconds, loss):
            raise RuntimeError("a step failed")

    config = TrainConfig(strategy="sequential", model="resnet18", image_size=32, batch_size=8, max_steps=3,
                                 run_dir=str(tmp_path / "run"), monitor_interval=0.05)
    prepared = trainer.prepare(config.resolved())
    with pytest.raises(RuntimeError, match="a step failed"):
        trainer.run(prepared, FailingObserver())
    assert not [t for t in threading.enumerate() if t.name.startswith("hybriddl-monitor")]
    rows = read_rows(tmp_path / "run" / "rank0-pidstat.csv", PIDSTAT_COLUMNS)
    assert rows  # stop() took the last sample on the way out
