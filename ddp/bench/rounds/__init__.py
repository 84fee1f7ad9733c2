"""Running rounds: the one training step (``trainer``), what each rank keeps between the parent's
calls (``rank_state``), the one timing loop (``measure``) and the figures of its rounds
(``summary``), and what drives them: the race (``race``), the all-reduce microbenchmark
(``allreduce``), a grid outside pytest (``grid``), the bucket sweep (``buckets``) and the rank side
of ``ddp profile`` (``profiling``)."""
