"""Data: sources → tokenizer → token stores on shared storage → packed samples read by position.

``sources`` lists and reads documents, ``tokenizer`` trains or loads the tokenizer, ``prepare``
tokenizes a source into a ``store`` in parallel Ray tasks, ``sampling`` orders a store's windows
(under the ``schemes`` a checkpoint records, holding out ``splits`` for the ``validation`` set), and
``batches`` reads each rank's micro-batches ahead from one global position; ``pipeline`` ties them
together for the driver and workers.
``integrity`` checks what is read: blocks against their checksums, tokens against the vocabulary.
"""

from meshtrain.data.integrity import CorruptTokens
from meshtrain.data.pipeline import DataPlan, TrainingData, open_data, prepare_data
from meshtrain.data.batches import DataParallelBatches
from meshtrain.data.sampling import IGNORE_INDEX, MixtureSamples, PackedSequences
from meshtrain.data.schemes import LEGACY_SAMPLING, SAMPLING_SCHEME, SAMPLING_SCHEMES, checkpoint_sampling
from meshtrain.data.validation import ValidationBatch, ValidationSet, ValidationWindow
from meshtrain.data.sources import expand_local_source, stdlib_source_files
from meshtrain.data.store import TokenStore, verify_store
from meshtrain.data.tokenizer import EOS_TOKEN, eos_token_id, tokenizer_vocab_size

__all__ = [
    "EOS_TOKEN",
    "CorruptTokens",
    "LEGACY_SAMPLING",
    "SAMPLING_SCHEME",
    "SAMPLING_SCHEMES",
    "DataParallelBatches",
    "DataPlan",
    "IGNORE_INDEX",
    "MixtureSamples",
    "PackedSequences",
    "TokenStore",
    "TrainingData",
    "ValidationBatch",
    "ValidationSet",
    "ValidationWindow",
    "checkpoint_sampling",
    "eos_token_id",
    "expand_local_source",
    "open_data",
    "prepare_data",
    "stdlib_source_files",
    "tokenizer_vocab_size",
    "verify_store",
]
