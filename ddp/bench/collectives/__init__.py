"""Collectives, one by one: steps recorded with each collective's ready, launch and completion on
a rank (``recording``), and the reading of recorded steps and profiler traces, each collective's
share of a step's exposed communication (``reading``: pure, the analysis layer reads it too)."""
