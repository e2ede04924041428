"""Distributed layout: the device-mesh shape, ("replicate", "shard") with "context" and "tensor" dims
when context or tensor parallel is on, and where shard groups landed (``mesh``), each rank's place in
the worker group (``layout``), tensor and context parallel, FSDP2 sharding with recompute, compile and
prefetch (``parallelize``), float8 linears (``float8``), the per-rank memory plan of a dry run
(``plan``), and the torch releases meshtrain supports (``torch_support``)."""
