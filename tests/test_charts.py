"""The charts and tables take plain rows with any keys: the report and compare draw with them."""

from __future__ import annotations

from hybriddl.monitoring.charts import markdown_table, speedup_chart, throughput_chart
from test_report import assert_png


def test_chart_functions_take_plain_rows_with_any_keys(tmp_path):
    rows = [{"name": "sequential", "ips": 10.0, "x": 1.0},
            {"name": "processes K=2", "ips": 19.0, "x": 1.9}]
    assert_png(throughput_chart(rows, tmp_path / "t.png", value_key="ips", label_key="name",
                                title="Tuner: throughput", highlight="processes K=2",
                                highlight_label="pick"))
    assert_png(speedup_chart(rows, tmp_path / "s.png", baseline="sequential, 1 core",
                             value_key="x", label_key="name"))


def test_markdown_table_escapes_pipes_and_marks_missing_values():
    text = markdown_table([{"a": "x|y", "b": 1.234}, {"a": "z", "b": None}],
                          [("a", "name", "{}"), ("b", "value", "{:.1f}")])
    assert text.splitlines() == ["| name | value |", "|---|---:|", "| x\\|y | 1.2 |", "| z | — |"]
