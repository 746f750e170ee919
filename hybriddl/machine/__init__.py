"""This machine: its facts, its name, and the one owner of each process-wide setting
(torch's thread count, glibc's malloc)."""
