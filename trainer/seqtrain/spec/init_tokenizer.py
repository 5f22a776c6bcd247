"""The tokenizer a fine-tune trains with must be the model's: checked at validation (torch-free).

`seqtrain.spec.resolve.init_tokenizer` gives a `model.init` folder's tokenizer.json to a job that names none. What
is left to refuse here: a tokenizer with ids the model's embedding does not have (an index error in the first step,
or worse with tensor parallel), and byte-level ids fed to a Hugging Face model with a vocabulary of its own (a Llama
trained on ids 0-255 runs, and reports success, on the wrong tokens).
"""

from __future__ import annotations

import os

from seqtrain.spec.data import TokenizerSpec
from seqtrain.spec.init_source import folder_tokenizer, local_folder
from seqtrain.spec.job import SeqTrainJob
from seqtrain.spec.model import ModelSpec
from seqtrain.spec.problems import Problem
from seqtrain.spec.resolve import BYTE_VOCAB, init_tokenizer, paths_readable, tokenizer_vocab_size


def data_tokenizer(job: SeqTrainJob) -> TokenizerSpec:
    """data.tokenizer as the trainer will use it (the model.init folder's when the spec names none)."""
    path = init_tokenizer(job)
    return TokenizerSpec(type="file", path=path) if path else job.spec.data.tokenizer


def tokenizer_problems(job: SeqTrainJob, m: ModelSpec) -> list[Problem]:
    """`m`: the resolved model. Problems of a model.init job whose text tokenizer does not fit the weights."""
    d, init = job.spec.data, job.spec.model.init
    if not init or ("://" in init and not init.startswith("hf://")) or not paths_readable() \
            or d.source in ("synthetic", "tokens") or not m.vocab_size:
        return []
    tok = data_tokenizer(job)
    if tok.type == "file":
        with_tok = job.model_copy(deep=True)
        with_tok.spec.data.tokenizer = tok
        have = tokenizer_vocab_size(with_tok)
        if have is not None and have > m.vocab_size:
            return [Problem("spec.data.tokenizer", f"{tok.path} has {have} token ids but the weights in model.init "
                                                   f"{init!r} have {m.vocab_size} (model.vocabSize); use the model's "
                                                   "own tokenizer.json (remove data.tokenizer to take the one in "
                                                   "the model.init folder)")]
        return []
    try:
        folder = local_folder(init)
    except ValueError:
        return []  # model.init's own check names it
    hf_folder = os.path.isfile(os.path.join(folder, "config.json")) and not os.path.isfile(
        os.path.join(folder, "seqtrain.json"))
    if hf_folder and m.vocab_size != BYTE_VOCAB:
        fix = ("remove data.tokenizer to train with the folder's own tokenizer.json" if folder_tokenizer(init) else
               "put the model's tokenizer.json in that folder, or set data.tokenizer {type: file, path: <its "
               "tokenizer.json>}")
        return [Problem("spec.data.tokenizer", f"byte-level ids (0-255) do not fit the {m.vocab_size}-token "
                                               f"vocabulary of the model in {init!r}; {fix}")]
    return []
