"""``ddp simulate`` against published measurements of other people's clusters (only the rows the project was
given: PyTorch's DDP benchmark table, kept outside the repository): run the simulator as a user would, and render the table of
docs/torchrun-and-simulate.md ("Validation on published rows") from its JSON.

    python -m tests.simulate_published --doc docs/torchrun-and-simulate.md

rewrites the table between its markers; tests/test_simulate_published.py keeps it true.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import tempfile
from pathlib import Path

from tabulate import tabulate

from ddp.bench.results.records import PredictionRecord, load_records
from ddp.cli import main as ddp_main

# PyTorch's DDP benchmark (benchmarks/distributed/ddp/README.md in pytorch/pytorch): resnet50, batch
# 32 per GPU, DGX-1 V100s, 8 a machine, 4 x 100 Gb/s InfiniBand; seconds per iteration, p50.
NO_DDP_SECONDS = 0.097
DDP_25MB_P50_SECONDS = {1: 0.100, 2: 0.103, 4: 0.103, 8: 0.104, 16: 0.104}
ONE_MB_THROUGHPUT_VS_25MB = {1: -0.003, 2: -0.010, 4: -0.016, 8: -0.026, 16: -0.038}  # its diff.py; negative: 1 MB slower

RESNET_COMMAND = [
    "simulate", "--model", "tests.resnet:build", "--batch-size", "32", "--seq-len", "1", "--strategies", "torch",
    "--bucket-sizes", "25,1", "--local-step-ms", "97", "--measured-step-ms", "1:100", "--world-sizes", "2,4,8,16",
    "--gpus-per-node", "8", "--link", "dgx1-v100", "--inter-link", "ib-4x100g",
]
BEGIN, END = "<!-- simulate_published: begin -->", "<!-- simulate_published: end -->"


def resnet_predictions() -> dict[tuple[float, int], PredictionRecord]:
    """(bucket MiB, world size) -> the prediction of the command above."""
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "out.json"
        with contextlib.redirect_stdout(io.StringIO()):
            assert ddp_main([*RESNET_COMMAND, "--json", str(out)]) == 0
        return {(p.bucket_size_mb, p.world_size): p for p in load_records(out, PredictionRecord)}


def table(predictions: dict[tuple[float, int], PredictionRecord]) -> str:
    rows = []
    for n, measured in DDP_25MB_P50_SECONDS.items():
        at_25, at_1 = predictions[(25.0, n)], predictions[(1.0, n)]
        measured_overhead, predicted_overhead = measured - NO_DDP_SECONDS, at_25.step_seconds - NO_DDP_SECONDS
        predicted_change = at_25.step_seconds / at_1.step_seconds - 1  # throughput of 1 MB against 25 MB
        rows.append([n, f"{measured * 1e3:.0f}", f"{at_25.step_seconds * 1e3:.1f}", f"{measured_overhead * 1e3:.0f}",
                     f"{predicted_overhead * 1e3:.1f}", f"{predicted_overhead / measured_overhead - 1:+.0%}",
                     f"{ONE_MB_THROUGHPUT_VS_25MB[n]:+.1%}", f"{predicted_change:+.1%}"])
    return tabulate(rows, headers=["GPUs", "DDP 25 MB ms", "predicted ms", "overhead ms", "predicted overhead ms",
                                   "overhead error", "1 MB vs 25 MB", "predicted"], tablefmt="github")


def rewrite(doc: Path, text: str) -> None:
    content = doc.read_text()
    head, _, rest = content.partition(BEGIN)
    _, _, tail = rest.partition(END)
    doc.write_text(f"{head}{BEGIN}\n{text}\n{END}{tail}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--doc", type=Path, default=None, help="rewrite the table between the markers of this file")
    args = parser.parse_args()
    rendered = table(resnet_predictions())
    print(rendered)
    if args.doc is not None:
        rewrite(args.doc, rendered)


if __name__ == "__main__":
    main()
