"""What a run saves and the arithmetic it is read with: the saved-run schema (``records``), the
statistics behind every interval (``stats``), model FLOPs and MFU (``flops``), the machine facts
(``machine``), and the pytest-benchmark side (``timing``: rounds handed to it; ``benchmark_json``:
runs measured outside pytest written as it writes them)."""
