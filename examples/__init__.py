"""Examples of what a user brings to ddp-bench: a model builder and DDP classes of their own."""
