"""`python bert.py export-hf --config ... --checkpoint-input DIR --output OUT`: a BERT or GroupBERT of
this project as a HuggingFace transformers directory.

The graph's weight names are the `BertForPreTraining` state-dict names (docs/design.md,
"Model"): the pre-training graph holds `bert.*` and `cls.*` (the MLM decoder is tied to the
word embedding and `cls.predictions.bias`, so it is left out, as transformers itself
saves it), the SQuAD graph `bert.*` without a pooler and the span head `qa_outputs.*`,
which is `BertForQuestionAnswering`'s, and the labelled tasks' `classifier.*`, which is
`BertForSequenceClassification`'s (with the pooler) and `BertForTokenClassification`'s
(config.json then names the labels, `id2label`, in the head's order). So the state dict is written as it is, under the
same names; config.json carries the sizes of the run's model and names the task's class
in `architectures`; vocab.txt and the tokenizer files carry the run's vocab and casing, so
`AutoTokenizer.from_pretrained(OUT)` tokenizes as this project does. transformers itself
is not needed to write the directory (it is a test dependency here): config.json holds
BertConfig's keys, and tokenizer.json is written by `tokenizers`.

GroupBERT has no class in transformers: its own, configuration_groupbert.py and
modeling_groupbert.py (bert/hf_groupbert/, importing only torch and transformers), are
copied into the directory, and config.json (`model_type` "groupbert") names them in
`auto_map`, so `AutoModelFor*.from_pretrained(OUT, trust_remote_code=True)` loads them. Their
state-dict names are the graph's too (GroupBERT's weights under `bert.*`, BERT's heads), so
the weights are written the same way; the pre-training export is `GroupBertForPreTraining`.
The directory appears whole or not at all (written under a temporary name, then renamed).
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Optional

import numpy as np
from onnx import numpy_helper
from safetensors.numpy import save

from fileio import DiskFull, disk_full, publish_directory
from bert.config import Architecture, Config, ModelConfig
from bert.io.sources import Vocabulary, build_with_weights, trained_start
from data.vocab import Vocab, load_vocab, make_tokenizer

__all__ = ["export_hf", "hf_config"]

# transformers' class of a task ("Bert" + its spec's hf_class) loads the weights of that task's graph
# under its names; GroupBERT's classes ("GroupBert" + hf_class) are shipped beside its weights
# (transformers remote code), named here by Auto class.
_GROUPBERT_CODE = Path(__file__).resolve().parents[1] / "hf_groupbert"
_GROUPBERT_FILES = ("configuration_groupbert.py", "modeling_groupbert.py")
_GROUPBERT_AUTO_MAP = {
    "AutoConfig": "configuration_groupbert.GroupBertConfig",
    "AutoModel": "modeling_groupbert.GroupBertModel",
    "AutoModelForPreTraining": "modeling_groupbert.GroupBertForPreTraining",
    "AutoModelForMaskedLM": "modeling_groupbert.GroupBertForMaskedLM",
    "AutoModelForSequenceClassification": "modeling_groupbert.GroupBertForSequenceClassification",
    "AutoModelForTokenClassification": "modeling_groupbert.GroupBertForTokenClassification",
    "AutoModelForQuestionAnswering": "modeling_groupbert.GroupBertForQuestionAnswering",
}
_SPECIAL_TOKENS = {"unk_token": "[UNK]", "sep_token": "[SEP]", "pad_token": "[PAD]", "cls_token": "[CLS]",
                   "mask_token": "[MASK]"}


def export_hf(config: Config, out: str | os.PathLike, checkpoint_input: Optional[str] = None) -> Path:
    """Write the BERT or GroupBERT weights of --checkpoint-input (or training.init_from) to `out`
    as a transformers directory; returns its path."""
    target = _check_target(Path(out))
    start = trained_start(config, checkpoint_input, "bert.py export-hf")  # the run's architecture is the config's
    if start.vocab is None:
        raise ValueError(f"{start.origin} records no vocab, and a transformers directory needs one (vocab.txt): pass "
                         "--data.vocab_file FILE, the vocab the model was trained with")
    proto, _ = build_with_weights(start.model, start, with_loss=False)
    weights = {t.name: numpy_helper.to_array(t) for t in proto.graph.initializer}
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        vocab = _write_tokenizer(tmp, start.vocab, start.model)
        config_json = hf_config(start.model, pad_token_id=vocab.pad_id)
        (tmp / "config.json").write_text(json.dumps(config_json, indent=2) + "\n", encoding="utf-8")
        _write_weights(tmp / "model.safetensors", weights)
        if start.model.architecture is Architecture.GROUPBERT:
            for name in _GROUPBERT_FILES:
                (tmp / name).write_bytes((_GROUPBERT_CODE / name).read_bytes())
        _usual_permissions(tmp)
        publish_directory(tmp, target)  # an empty directory at `target` is replaced; any other is refused above
    except OSError as e:  # every file is written by Python (below), so a full disk is an OSError that names none
        shutil.rmtree(tmp, ignore_errors=True)
        if disk_full(e):
            raise DiskFull(f"the disk is full: cannot write the HuggingFace directory {target} ({e.strerror}); "
                             "nothing earlier was lost (the partial directory was removed): free space and run "
                             "again") from None
        raise OSError(e.errno, e.strerror or str(e), str(target)) from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    groupbert = start.model.architecture is Architecture.GROUPBERT
    print(f"exported {start.model.task.value} {'GroupBERT' if groupbert else 'BERT'} from {start.origin} to {target} "
          f"as a HuggingFace {config_json['architectures'][0]} directory (config.json, model.safetensors, vocab.txt, "
          f"tokenizer files{', the GroupBERT code: load it with trust_remote_code=True' if groupbert else ''})")
    return target


def hf_config(model: ModelConfig, pad_token_id: int = 0) -> dict:
    """config.json: transformers' BertConfig keys for `model`'s sizes (erf GELU, absolute positions);
    for GroupBERT, GroupBertConfig's (bert/hf_groupbert/configuration_groupbert.py)."""
    if model.architecture is Architecture.GROUPBERT:
        return _groupbert_config(model, pad_token_id)
    return {
        "architectures": ["Bert" + model.task.spec.hf_class],
        "model_type": "bert",
        "vocab_size": model.vocab_size,
        "hidden_size": model.hidden_size,
        "num_hidden_layers": model.num_layers,
        "num_attention_heads": model.num_heads,
        "intermediate_size": model.intermediate_size,
        "hidden_act": "gelu",  # erf GELU, as bert/model.py's gelu
        "hidden_dropout_prob": model.hidden_dropout,
        "attention_probs_dropout_prob": model.attention_dropout,
        "max_position_embeddings": model.max_positions,
        "type_vocab_size": model.type_vocab_size,
        "initializer_range": model.init_std,
        "layer_norm_eps": model.layer_norm_eps,
        "position_embedding_type": "absolute",
        "pad_token_id": pad_token_id,
        "tie_word_embeddings": True,  # the MLM decoder is the word embedding
        "classifier_dropout": None,
        **_labels(model),
    }


def _groupbert_config(model: ModelConfig, pad_token_id: int) -> dict:
    """GroupBertConfig's keys: BertConfig's sizes, the convolution and the FFN groups; `auto_map`
    names the classes copied beside the weights."""
    return {
        "architectures": ["GroupBert" + model.task.spec.hf_class],
        "model_type": "groupbert",
        "auto_map": _GROUPBERT_AUTO_MAP,
        "vocab_size": model.vocab_size,
        "hidden_size": model.hidden_size,
        "num_hidden_layers": model.num_layers,
        "num_attention_heads": model.num_heads,
        "intermediate_size": model.intermediate_size,
        "max_position_embeddings": model.max_positions,
        "type_vocab_size": model.type_vocab_size,
        "layer_norm_eps": model.layer_norm_eps,
        "conv_kernel_size": model.conv_kernel,
        "conv_group_size": model.conv_group_size,
        "ffn_groups": model.ffn_groups,
        "hidden_dropout_prob": model.hidden_dropout,
        "attention_probs_dropout_prob": model.attention_dropout,
        "initializer_range": model.init_std,
        "pad_token_id": pad_token_id,
        **_labels(model),
    }


def _labels(model: ModelConfig) -> dict:
    """A labelled task's head as transformers names it: its labels (id2label) and problem type."""
    if not model.task.labelled:
        return {}
    names = model.labels or tuple(f"LABEL_{i}" for i in range(model.outputs))
    problem = model.task.spec.problem_type  # a sequence head's; HF's token head sets none
    return {"id2label": {str(i): name for i, name in enumerate(names)},
            "label2id": {name: i for i, name in enumerate(names)},
            **({"problem_type": problem} if problem is not None else {})}


def _check_target(target: Path) -> Path:
    """`target` if a directory can be written there: absent or empty, under a directory."""
    if target.is_dir() and any(target.iterdir()):
        raise ValueError(f"export-hf --output {target} is a directory that is not empty: name a new directory (nothing "
                         "there is overwritten)")
    if target.exists() and not target.is_dir():
        raise ValueError(f"export-hf --output {target} is a file: name a new directory")
    parent = target.absolute().parent
    existing = next(p for p in (parent, *parent.parents) if p.exists())
    if not existing.is_dir():
        raise ValueError(f"export-hf --output {target}: {existing} is a file, not a directory: name a directory elsewhere")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"export-hf --output {target}: {existing} is not writable: name a directory elsewhere")
    return target


def _usual_permissions(directory: Path) -> None:
    """The modes a plain mkdir and open give (mkdtemp and safetensors make them private)."""
    umask = os.umask(0)
    os.umask(umask)
    directory.chmod(0o777 & ~umask)
    for f in directory.iterdir():
        f.chmod(0o666 & ~umask)


def _write_tokenizer(directory: Path, vocab: Vocabulary, model: ModelConfig) -> Vocab:
    """vocab.txt, tokenizer.json, tokenizer_config.json and special_tokens_map.json; returns the vocab."""
    path = directory / "vocab.txt"
    path.write_text(vocab.text, encoding="utf-8")
    try:
        tokens = load_vocab(path)
    except ValueError as e:
        raise ValueError(f"the vocab of {vocab.origin} cannot make a BERT tokenizer: {e}") from None
    if tokens.size > model.vocab_size:
        raise ValueError(f"the vocab of {vocab.origin} has {tokens.size} tokens, more than the model's "
                         f"{model.vocab_size} embedding rows: it is not this model's vocab")
    # Written by Python, not by tokenizers' own save: a failed write is then an OSError.
    (directory / "tokenizer.json").write_text(make_tokenizer(tokens, lower_case=vocab.lower_case).to_str(pretty=True),
                                              encoding="utf-8")
    settings = {
        "tokenizer_class": "BertTokenizer",
        "do_lower_case": vocab.lower_case,
        "strip_accents": None,  # follows do_lower_case, as make_tokenizer's
        "tokenize_chinese_chars": True,
        "model_max_length": model.max_positions,
        **_SPECIAL_TOKENS,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(settings, indent=2) + "\n", encoding="utf-8")
    (directory / "special_tokens_map.json").write_text(json.dumps(_SPECIAL_TOKENS, indent=2) + "\n", encoding="utf-8")
    return tokens


def _write_weights(path: Path, weights: dict[str, np.ndarray]) -> None:
    state = {name: np.ascontiguousarray(value, dtype=np.float32) for name, value in sorted(weights.items())}
    # transformers reads a safetensors file whose metadata names its framework ("pt"). The
    # bytes are written by Python: safetensors' own file writer reports a full disk as a
    # SafetensorError that says only "os error 28"; a BERT's weights fit in memory twice.
    path.write_bytes(save(state, metadata={"format": "pt"}))
