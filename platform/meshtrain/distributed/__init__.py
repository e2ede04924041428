"""Distributed layout: the 2D ("replicate", "shard") mesh shape and where shard groups landed
(``mesh``), each rank's place in the worker group (``layout``), FSDP2 sharding with recompute,
compile and prefetch (``parallelize``), and the per-rank memory plan of a dry run (``plan``)."""
