"""Training data: corpora (text, token files), tokenizers, and the grain pipeline that turns tokens into
per-process batches. Other modules import the names below from ``jaxtrain.data``."""

from jaxtrain.data.pipeline import (DOC_SEPARATOR, Corpus, GlobalBatches, Windows, check_sizes, eval_batches,
                                    is_validation_file, load_corpus, stdlib_files, text_files, train_batches)

__all__ = ["DOC_SEPARATOR", "Corpus", "GlobalBatches", "Windows", "check_sizes", "eval_batches", "is_validation_file",
           "load_corpus", "stdlib_files", "text_files", "train_batches"]
