"""The GPU acceptance stages of ``python -m ddp gpu-check`` (``gpu_stages``): each checks, on one
GPU, a claim of the suite that only a GPU can show. A user of the measurement core, as the suites
are: above the analysis, below the command line, which only parses and prints."""
