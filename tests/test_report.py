import csv
import json
import time

import pytest
from matplotlib.image import imread

from hybriddl.errors import UsageError
from hybriddl.monitoring.monitor import PIDSTAT_COLUMNS, SAR_COLUMNS, Monitor
from hybriddl.monitoring.report import configuration_label, read_samples, write_report
from hybriddl.strategies import StrategySpec
from hybriddl.rundir import METRICS

T0 = 1_700_000_000.0


def write_csv(path, columns, rows):
    with open(path, "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(columns)
        writer.writerows(rows)


def make_run(path, strategy, images_per_second, hosts=1, ranks=(0,), lo_bytes_per_s=1e6):
    """A run directory as `train` leaves it: metrics.json and each rank's monitor CSVs."""
    path.mkdir(parents=True)
    epochs = [{"epoch": i + 1, "steps": 10, "samples": 320, "seconds": 320 / ips,
               "images_per_second": ips, "train_loss": 1.0, "val_accuracy": 0.5,
               "data_wait_seconds": 0.0, "mpi_bytes_sent": 0,
               "started_at": T0 + 1 + 12 * i, "ended_at": T0 + 1 + 12 * i + 320 / ips}
              for i, ips in enumerate(images_per_second)]
    metrics = {"config": {"usecase": "ComplexSmall", "model": "vgg16", "strategy": strategy,
                          "hosts": {"count": hosts, "names": [f"h{i}" for i in range(hosts)]},
                          "global_batch": 32, "image_size": 32},
               "epochs": epochs,
               "monitor": {"rank": 0, "started_at": T0, "host_cpus": 2,
                           "process": {"cpu_avg_pct": 150.0, "cpu_peak_pct": 199.0,
                                       "rss_peak_bytes": 512 * 2**20},
                           "network": {"lo": {"rx_bytes": 30 * 2**20, "tx_bytes": 30 * 2**20},
                                       "eth0": {"rx_bytes": 0, "tx_bytes": 0}}}}
    (path / METRICS).write_text(json.dumps(metrics))
    seconds = range(1, 12 * len(images_per_second) + 1)
    for rank in ranks:
        write_csv(path / f"rank{rank}-pidstat.csv", PIDSTAT_COLUMNS,
                  [(T0 + s, s, 1.0, 100, 1, 120.0, 30.0, 150.0, 500.0 + s, 3.2, 8) for s in seconds])
        write_csv(path / f"rank{rank}-sar.csv", SAR_COLUMNS,
                  [(T0 + s, s, 1.0, 70.0, 20.0, 0.0, 10.0, 40.0, name, rate, rate, 100.0, 100.0)
                   for s in seconds for name, rate in (("lo", lo_bytes_per_s), ("eth0", 0.0))])
    return path


def assert_png(path):
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    height, width, _ = imread(path).shape
    assert height > 200 and width > 300


def table_row(report_text, run_name):
    return next(line for line in report_text.splitlines() if line.startswith(f"| {run_name} |"))


def test_report_draws_scaling_charts_resources_and_table(tmp_path):
    seq = make_run(tmp_path / "run-seq", {"name": "sequential"}, [10.0, 10.0])
    thr = make_run(tmp_path / "run-thr", {"name": "threads", "workers": 2}, [24.0, 25.0, 26.0],
                   hosts=2, ranks=(0, 1))
    output = tmp_path / "report"
    written = write_report([seq, thr], output)

    names = {p.name for p in written}
    assert names == {"epoch_time.png", "throughput.png", "speedup.png", "report.md",
                     "resources-run-seq-rank0.png", "resources-run-thr-rank0.png",
                     "resources-run-thr-rank1.png"}
    for path in written:
        if path.suffix == ".png":
            assert_png(path)
    text = (output / "report.md").read_text()
    assert "speedup is images/s over sequential (run-seq)" in text
    assert "| run-seq | sequential, 1 host |" in text
    thr_row = table_row(text, "run-thr")
    assert "| threads K=2, 2 hosts |" in thr_row
    assert "| 25.0 | 2.50× |" in thr_row  # median images/s, and 25 / 10
    assert "| 512 |" in thr_row and "lo 30.0 / 30.0" in thr_row and "eth0" not in thr_row
    for name in names - {"report.md"}:
        assert f"({name})" in text  # every chart is embedded in the Markdown


def test_a_run_is_labelled_as_its_strategy_labels_itself():
    """One label for every display of a strategy: numerics and accumulation included."""
    strategy = {"name": "threads", "workers": 2, "precision": "bf16", "channels_last": True,
                "accumulate": 4}
    label = configuration_label({"strategy": strategy, "hosts": {"count": 2}})
    assert label == f"{StrategySpec.from_dict(strategy).label}, 2 hosts"
    assert label == "threads K=2 bf16 channels_last accumulate=4, 2 hosts"


def test_without_a_sequential_run_the_first_run_is_the_baseline(tmp_path):
    a = make_run(tmp_path / "a", {"name": "threads", "workers": 2}, [20.0])
    b = make_run(tmp_path / "b", {"name": "processes", "workers": 2}, [30.0])
    write_report([a, b], tmp_path / "out")
    text = (tmp_path / "out" / "report.md").read_text()
    assert "over the first run (threads K=2, 1 host)" in text
    assert "| 1.50× |" in table_row(text, "b")


def test_report_of_a_really_monitored_run(tmp_path):
    run = tmp_path / "real"
    with Monitor(run, rank=0, interval=0.05) as monitor:
        started = time.time()
        end = time.thread_time() + 0.3
        while time.thread_time() < end:
            sum(i * i for i in range(10000))
        ended = time.time()
    metrics = {"config": {"strategy": {"name": "sequential"}, "hosts": {"count": 1}},
               "epochs": [{"epoch": 1, "seconds": ended - started, "images_per_second": 8.0,
                           "started_at": started, "ended_at": ended}],
               "monitor": monitor.summary()}
    (run / METRICS).write_text(json.dumps(metrics))
    written = write_report([run], tmp_path / "out")
    assert_png(tmp_path / "out" / "resources-real-rank0.png")
    assert len(written) == 5


def test_partial_last_row_is_tolerated_but_a_damaged_middle_row_is_not(tmp_path):
    path = tmp_path / "rank0-pidstat.csv"
    good = ",".join(["1.0"] * len(PIDSTAT_COLUMNS))
    path.write_text(",".join(PIDSTAT_COLUMNS) + f"\n{good}\n{good}\n1.0,2.")
    assert len(read_samples(path, PIDSTAT_COLUMNS)) == 2  # a run killed mid-write
    path.write_text(",".join(PIDSTAT_COLUMNS) + f"\n{good}\n1.0,2.\n{good}\n")
    with pytest.raises(UsageError, match="line 3 is malformed"):
        read_samples(path, PIDSTAT_COLUMNS)


@pytest.mark.parametrize("damage, message", [
    ("missing", "has no metrics.json"),
    ("json", "is not valid JSON"),
    ("no-epochs", "no finished epoch"),
    ("csv-header", "does not start with the monitor's header"),
    ("binary", "is not a text file"),
    ("a-folder", "cannot read it"),
])
def test_bad_run_directory_is_one_line_exit_2_and_writes_nothing(tmp_path, capsys, damage, message):
    from hybriddl.cli import main

    good = make_run(tmp_path / "good", {"name": "sequential"}, [10.0])
    bad = make_run(tmp_path / "bad", {"name": "threads", "workers": 2}, [20.0])
    if damage == "missing":
        (bad / METRICS).unlink()
    elif damage == "json":
        (bad / METRICS).write_text((bad / METRICS).read_text()[:40])
    elif damage == "binary":  # a model.pt copied over it
        (bad / METRICS).write_bytes(b"\x80\x02\xff\xfe" * 8)
    elif damage == "a-folder":
        (bad / METRICS).unlink()
        (bad / METRICS).mkdir()
    elif damage == "no-epochs":
        metrics = json.loads((bad / METRICS).read_text())
        (bad / METRICS).write_text(json.dumps({**metrics, "epochs": []}))
    else:
        (bad / "rank0-sar.csv").write_text("time,cpu\n1,2\n")
    output = tmp_path / "out"
    assert main(["report", str(good), str(bad), "--output", str(output)]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1 and "Traceback" not in err
    assert not output.exists()


def test_report_command_end_to_end(cli, tmp_path):
    seq = make_run(tmp_path / "seq", {"name": "sequential"}, [10.0])
    # Wide enough for the whole path in the table (a worker's temporary folder is long).
    done = cli("report", str(seq), "--output", str(tmp_path / "out"), COLUMNS="400")
    assert done.returncode == 0, done.stderr
    assert "report.md" in done.stdout
    assert_png(tmp_path / "out" / "speedup.png")


def test_runs_with_the_same_configuration_and_folder_name_stay_apart(tmp_path):
    a = make_run(tmp_path / "a" / "run", {"name": "sequential"}, [10.0])
    b = make_run(tmp_path / "b" / "run", {"name": "sequential"}, [12.0])
    written = write_report([a, b], tmp_path / "out")
    assert len([p for p in written if p.name.startswith("resources-")]) == 2
    text = (tmp_path / "out" / "report.md").read_text()
    assert "| #1 run | sequential, 1 host (#1 run) |" in text
    assert "| 1.20× |" in table_row(text, "#2 run")


@pytest.mark.parametrize("failing", ["report.md", "speedup.png"])
def test_a_full_disk_is_one_line_and_leaves_no_temporary_file(tmp_path, capsys, monkeypatch,
                                                              failing):
    from hybriddl import files
    from hybriddl.cli import main

    real_fsync = files.os.fsync

    def fsync(fd):  # the disk fills while this file is written
        if files.os.readlink(f"/proc/self/fd/{fd}").split("/")[-1].startswith(f".{failing}"):
            raise OSError(28, "No space left on device")
        real_fsync(fd)
    monkeypatch.setattr(files.os, "fsync", fsync)
    seq = make_run(tmp_path / "seq", {"name": "sequential"}, [10.0])
    output = tmp_path / "out"
    assert main(["report", str(seq), "--output", str(output)]) != 0
    err = capsys.readouterr().err.strip()
    assert f"writing {output / failing} failed: No space left on device" in err
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert not list(output.glob(".*tmp*")) and not (output / failing).exists()


def test_a_hand_edited_float_global_batch_is_shown_not_a_traceback(tmp_path):
    run = make_run(tmp_path / "seq", {"name": "sequential"}, [10.0])
    metrics = json.loads((run / METRICS).read_text())
    metrics["config"]["global_batch"] = 32.0
    (run / METRICS).write_text(json.dumps(metrics))
    write_report([run], tmp_path / "out")
    assert "| 32.0 |" in table_row((tmp_path / "out" / "report.md").read_text(), "seq")


def test_a_monitor_file_with_a_field_past_the_csv_limit_is_damage_not_a_traceback(tmp_path):
    run = make_run(tmp_path / "seq", {"name": "sequential"}, [10.0])
    with open(run / "rank0-sar.csv", "a") as handle:
        handle.write("\0" * 200_000 + "\n")  # a crash's tail of NULs
    with pytest.raises(UsageError, match="rank0-sar.csv .*the run directory is damaged"):
        write_report([run], tmp_path / "out")



@pytest.mark.parametrize(("edit", "says"), [
    (lambda m: m["config"].update(hosts=2), "AttributeError"),
    (lambda m: m["config"]["strategy"].update(workers="four"), "ValueError"),
    (lambda m: m["monitor"]["network"]["lo"].pop("rx_bytes"), "KeyError"),
    (lambda m: m["epochs"][0].update(seconds=float("inf")), "finite positive 'seconds'"),
])
def test_a_hand_edited_metrics_file_is_one_line_naming_it(tmp_path, edit, says):
    run = make_run(tmp_path / "seq", {"name": "sequential"}, [10.0])
    metrics = json.loads((run / METRICS).read_text())
    edit(metrics)
    (run / METRICS).write_text(json.dumps(metrics))
    with pytest.raises(UsageError, match=f"{METRICS}: .*{says}"):
        write_report([run], tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_suffixed_name_does_not_take_another_runs_charts(tmp_path):
    """Runs named a, a-2 and a: the second `a` was suffixed with the count of names used
    (2), which is the other run's name, and its charts replaced that run's."""
    runs = [make_run(tmp_path / parent / name, {"name": "sequential"}, [10.0 + i])
            for i, (parent, name) in enumerate((("x", "a"), ("y", "a-2"), ("z", "a")))]
    written = write_report(runs, tmp_path / "out")
    charts = [p.name for p in written if p.name.startswith("resources-")]
    assert len(charts) == len(set(charts)) == 3, charts
