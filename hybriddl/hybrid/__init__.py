"""Hosts dividing a step between them: data parallelism or the classifier split across hosts."""
