"""The model: the Llama decoder (``llama``), the document mask (``documents``), its loss (``loss``),
weight initialization that is the same on every mesh (``init``), FLOPs per token (``flops``), Hugging
Face names and ``config.json`` (``hf_llama``), and the resolved shape of a run (``args``). Sharding is
applied from outside (``meshtrain.distributed.parallelize``); the distributed code here is what the
model's own math needs: attention over a context-parallel group (``context_parallel``, which gathers
keys and values), the vocabulary-parallel cross entropy of a tensor-parallel head (``loss``), and each
shard's rows of the initial weights (``init``, from DTensor offsets)."""
