"""Training data: text sources (documents.py), tokenizers (tokenizer.py), token files (token_file.py), the
token stream a run trains on (corpus.py), instruction data (sft.py), the grain pipeline that turns it into
per-process batches (pipeline.py), and the data and batches of either data.format (batches.py: ``load_data``).
Other modules import these names from ``jaxtrain.data``.

The pipeline's and the batches' names load on first use: they import jax, which the tokenizer commands do without.
"""

from jaxtrain.data.corpus import Corpus, load_corpus
from jaxtrain.data.documents import is_validation_file, stdlib_files, text_files
from jaxtrain.data.token_file import read_token_file, write_token_file
from jaxtrain.data.tokenizer import TextTokenizer, hf_tokenizer_files, load_tokenizer, train_tokenizer

_PIPELINE = ("GlobalBatches", "HostBatches", "PLAIN_SEEDS", "SPREAD_SEEDS", "Windows", "check_sizes", "grain_seed")
_BATCHES = ("Epoch", "batch_fields", "epoch", "eval_batches", "load_data", "steps_for_epochs", "train_batches")

__all__ = ["Corpus", "TextTokenizer", "hf_tokenizer_files", "is_validation_file", "load_corpus", "load_tokenizer",
           "read_token_file", "stdlib_files", "text_files", "train_tokenizer", "write_token_file", *_PIPELINE, *_BATCHES]


def __getattr__(name: str):
    if name in _PIPELINE:
        from jaxtrain.data import pipeline

        return getattr(pipeline, name)
    if name in _BATCHES:
        from jaxtrain.data import batches

        return getattr(batches, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
