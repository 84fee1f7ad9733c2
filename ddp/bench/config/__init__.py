"""What is benchmarked, and how it is asked for: a step's configuration (``step_config``: every
axis declared once), the shape of its step (``shape``), what its precision sets (``precision``),
the workloads (``workloads``), and the one options layer of pytest and every command
(``options``, ``parsing``). Pure declarations: nothing here builds a model on a device or starts
a rank."""
