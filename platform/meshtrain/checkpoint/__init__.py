"""State on storage: what a checkpoint holds (``state``), where checkpoints live and which are
committed (``storage``), saving, committing, pruning and restoring them (``manager``), exporting
consolidated weights (``export``) and loading Hugging Face weights (``hf_weights``)."""
