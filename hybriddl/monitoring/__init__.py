"""What a run costs: system monitors (pidstat/sar style) and reports."""
