"""The model: the Llama decoder (``llama``), its loss (``loss``), weight initialization that is the
same on every mesh (``init``), FLOPs per token (``flops``), Hugging Face names and ``config.json``
(``hf_llama``), and the resolved shape of a run (``args``). No distributed code lives here."""
