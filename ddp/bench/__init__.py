"""The benchmark core: options, workloads, the one training step and timing loop, the saved-run
schema, statistics and the all-reduce benchmark. Imports strategies, the model and the launcher;
nothing here parses a command line or renders a report."""
