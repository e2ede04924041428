"""State on storage: what a checkpoint holds (``state``), where checkpoints live, which are committed
and which were marked bad (``storage``), saving, committing, pruning and restoring them with
fallback past broken ones (``manager``), exporting consolidated weights (``export``) and loading
Hugging Face weights (``hf_weights``).

Storage is untrusted: DCP's files are written and read through ``dcp_files`` (checksums taken as
they are written, see ``checksums``; nothing unpickled beyond DCP's metadata classes and plain data,
see ``safe_unpickling``). ``errors`` holds the failures, ``save_failures`` turns a full or read-only
disk into one line."""
