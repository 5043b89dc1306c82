"""What a labelled task predicts, and everything that follows from it, in one object per kind
(a `TaskSpec`'s `targets`): how its file is read and its gold encoded, the head's width, the
graph's label input and loss, its figures and when they show a model that learned nothing,
its predictions file, and what serving answers.

    Classes   one label per row (classification): int ids into model.labels, softmax
              cross-entropy; accuracy, F1, MCC (scikit-learn); served as top-k labels
    Values    one number per row (regression): one output, float targets, the mean squared
              error; Pearson, Spearman, MSE (scipy); served as the value
    Tags      a tag per word (tokens): the first sub-word of each word labelled, the rest
              ignored; entity F1 (seqeval); served as entities (bert/io/serve.py `tag`)
    LabelSets any number of labels per row (multi_label): a sigmoid per label, binary
              cross-entropy; micro and macro F1, whole-set accuracy (scikit-learn);
              served as every label's probability

The callers (bert/tasks/labelled.py, bert/model.py, bert/io/serve.py, bert/config) hold no test of
which kind they have. A new kind is a subclass here and a spec that names it.

This module imports numpy and nothing of the project when loaded (bert/tasks/spec.py
creates the kinds, and a config is checked without torch or the builder); what a method
needs (the readers, the metrics, the graph's ops) is imported when it is called.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Callable, Optional, Union

import numpy as np

if TYPE_CHECKING:
    from bert.config import Config, ModelConfig
    from builder import Builder, Tensor
    from data.labelled import Table, Tagged

__all__ = ["Classes", "LabelSets", "Tags", "Targets", "Values", "softmax"]

# A dev set's predictions: label ids, values, or each sentence's tags.
Prediction = Union[np.ndarray, list[list[str]]]


class Targets:
    """The default behaviour is a classifier's over a table of rows; kinds override what differs."""

    one_output = False  # a single output, not named: the head is 1 wide and has no labels
    what = "labels"  # what a file's names are called in messages

    @property
    def named(self) -> bool:
        """The head's outputs are named by model.labels (served by those names)."""
        return not self.one_output

    # ------------------------------------------------------------------ config
    def outputs(self, model: "ModelConfig") -> Optional[int]:
        """The head's width: model.num_labels, the labels named, or 1 for a single output."""
        if self.one_output:
            return model.num_labels or 1
        return model.num_labels or (len(model.labels) if model.labels is not None else None)

    def check(self, model: "ModelConfig") -> None:
        """A model config this kind cannot have is refused in one line."""
        if self.one_output and model.outputs not in (None, 1):
            raise ValueError(f"a {model.task.value} head has one output, not num_labels {model.outputs}: remove "
                             "num_labels")

    # ------------------------------------------------------------------ files
    def read(self, config: "Config", path: str, format_option: str = "data.format") -> Union["Table", "Tagged"]:
        """The rows of a labelled file as the config's columns name them; `format_option`: the
        setting that gives data.format, as the reader's errors name it (infer.py's --format)."""
        from data.labelled import read_table

        d = config.data
        if d.text_columns is None or d.label_column is None:
            raise ValueError(f"model.task {config.model.task.value!r} needs data.text_columns (one column, or two for "
                             "sentence pairs) and data.label_column, by name or 0-based index")
        return read_table(path, d.text_columns, d.label_column, header=d.header, fmt=d.format,
                          max_line_bytes=d.max_line_bytes, format_option=format_option)

    def names(self, found: Union["Table", "Tagged"]) -> tuple[str, ...]:
        """The distinct labels of a training file, sorted (as HF's run_glue sorts them)."""
        from data.labelled import label_names

        return label_names(found.labels)

    def with_labels(self, model: "ModelConfig", found: Union["Table", "Tagged"]) -> "ModelConfig":
        """The model with its head's labels: model.labels, else the training file's, sorted;
        a file label beyond model.labels or model.num_labels is an error."""
        if not self.named:
            return model
        names, what = self.names(found), self.what
        _check_file_labels(found, names, what)
        if model.labels is not None:
            lacking = [n for n in names if n not in model.labels]
            if lacking:
                raise ValueError(f"{found.path} has {what} {lacking} that model.labels {list(model.labels)} lacks: "
                                 "add them, or remove model.labels to take the file's")
            return model
        if model.num_labels is not None and len(names) > model.num_labels:
            raise ValueError(f"{found.path} has {len(names)} {what} {list(names)}, more than the head's "
                             f"model.num_labels {model.num_labels}: raise model.num_labels, or remove it to take the "
                             "file's")
        width = model.num_labels or len(names)
        labels = tuple(names) + tuple(f"LABEL_{i}" for i in range(len(names), width))  # HF's names for unused outputs
        return model.model_copy(update={"labels": labels, "num_labels": width})

    def gold(self, model: "ModelConfig", found: "Table") -> np.ndarray:
        """Each row's target as the graph's labels take it: (N,) int64 label ids."""
        from data.labelled import label_ids

        return label_ids(found.labels, model.labels, found.path, found.lines)

    def features(self, config: "Config", found: Union["Table", "Tagged"], tokenizer
                 ) -> tuple[dict[str, np.ndarray], Any, Optional[list[list[str]]]]:
        """A file's rows as graph arrays (inputs and labels), their gold, and the words of
        each row (tokens; else None); truncated to model.sequence_length, said once per file."""
        from data.labelled import sentence_features

        s = config.model.sequence_length
        arrays = sentence_features(tokenizer, found.texts, s)
        _say_truncated(int(arrays.pop("truncated").sum()), len(found.texts), found.path, s, "rows",
                       "the longer member of a pair first" if len(found.texts[0]) == 2 else "the text's end")
        gold = self.gold(config.model, found)
        return {**arrays, "labels": gold}, gold, None

    # ------------------------------------------------------------------ graph
    def loss(self, b: "Builder", model: "ModelConfig", logits: "Tensor", shape: list,
             used: Callable[[], "Tensor"]) -> "Tensor":
        """The graph's `labels` input, of `shape` (a row's, a packed row's slots, or the
        positions), and the mean loss of `logits` (…, L) against it; `used()`: (B·N,) 1 where
        a packed slot holds a sequence (calling it adds the mask to the graph)."""
        from bert.model import cross_entropy, flatten
        from builder import INT64

        labels = flatten(b, b.input("labels", shape, INT64))
        return cross_entropy(b, flatten(b, logits, (model.outputs,)), labels)

    # ------------------------------------------------------------------ figures
    def figures(self, model: "ModelConfig", rows, logits: np.ndarray) -> tuple[dict, Prediction]:
        """The task's figures on `rows` (bert/tasks/labelled.py's Rows) from their logits (one row
        each, unpacked), and the predictions."""
        from bert.tasks.metrics import classification_scores

        labels = logits.argmax(-1)
        return classification_scores(labels, rows.gold, model.outputs), labels

    def degenerate(self, model: "ModelConfig", rows, predicted: Prediction) -> Optional[str]:
        """Why the dev predictions show a model that learned nothing of its task, or None (bert/tasks/metrics.py)."""
        from bert.tasks.metrics import degenerate_classes

        return degenerate_classes(predicted, rows.gold, model.labels)

    def predictions(self, model: "ModelConfig", rows, predicted: Prediction) -> tuple[str, list[str]]:
        """The predictions file's name in the run directory and its lines."""
        return "predictions.tsv", ["line\tprediction\tlabel"] + [
            f"{n}\t{model.labels[p]}\t{model.labels[g]}" for n, p, g in zip(rows.lines, predicted, rows.gold)]

    # ------------------------------------------------------------------ serving
    def served(self, model: "ModelConfig", logits: np.ndarray, top_k: int) -> list[dict]:
        """infer.py --task classify's answer per row: {"labels": [(label, probability), ...]}
        best first, top_k of them."""
        probs = self.probabilities(logits)
        best = np.argsort(-probs, axis=-1, kind="stable")[:, :top_k]
        return [{"labels": [(model.labels[j], float(p[j])) for j in order]} for p, order in zip(probs, best)]

    def probabilities(self, logits: np.ndarray) -> np.ndarray:
        """Each output's probability: a softmax over the labels."""
        return softmax(logits)


class Classes(Targets):
    """One label per row: HF's single_label_classification."""


class Values(Targets):
    """One number per row: HF's regression (num_labels 1)."""

    one_output = True

    def gold(self, model: "ModelConfig", found: "Table") -> np.ndarray:
        """(N,) float32: each label as a finite number."""
        from data.labelled import regression_targets

        return regression_targets(found.labels, found.path, found.lines)

    def loss(self, b: "Builder", model: "ModelConfig", logits: "Tensor", shape: list,
             used: Callable[[], "Tensor"]) -> "Tensor":
        """The mean squared error; packed, over the slots that hold a sequence."""
        from bert.model import flatten
        from builder import FLOAT

        error = b.onnx.Sub(flatten(b, logits), flatten(b, b.input("labels", shape, FLOAT)))  # (B·N,)
        squared = b.onnx.Mul(error, error)
        if not model.packed:
            return b.onnx.ReduceMean(squared, keepdims=0)
        return _slot_mean(b, squared, used())

    def figures(self, model: "ModelConfig", rows, logits: np.ndarray) -> tuple[dict, Prediction]:
        from bert.tasks.metrics import regression_scores

        return regression_scores(logits[:, 0], rows.gold), logits[:, 0]

    def degenerate(self, model: "ModelConfig", rows, predicted: Prediction) -> Optional[str]:
        from bert.tasks.metrics import degenerate_values

        return degenerate_values(predicted, rows.gold)

    def predictions(self, model: "ModelConfig", rows, predicted: Prediction) -> tuple[str, list[str]]:
        return "predictions.tsv", ["line\tprediction\tlabel"] + [
            f"{n}\t{p:.6g}\t{g:.6g}" for n, p, g in zip(rows.lines, predicted, rows.gold)]

    def served(self, model: "ModelConfig", logits: np.ndarray, top_k: int) -> list[dict]:
        """Per row: {"value": v}."""
        return [{"value": float(v)} for v in logits[:, 0]]


class Tags(Targets):
    """An IOB tag per word: the first sub-word of each word labelled, the rest ignored (-100)."""

    what = "tags"

    def read(self, config: "Config", path: str, format_option: str = "data.format") -> "Tagged":
        from data.labelled import read_tagged

        d = config.data
        words = d.text_columns[0] if d.text_columns else 0
        tags = d.label_column if d.label_column is not None else -1
        if not isinstance(words, int) or not isinstance(tags, int) or (d.text_columns and len(d.text_columns) > 1):
            raise ValueError("model.task 'tokens' reads one word column and one tag column by 0-based index: set "
                             "data.text_columns [0] and data.label_column -1 (CoNLL), or leave them out")
        return read_tagged(path, words, tags, fmt=d.format, max_line_bytes=d.max_line_bytes,
                           format_option=format_option)

    def names(self, found: "Tagged") -> tuple[str, ...]:
        from data.labelled import tag_names

        return tag_names(found.tags)

    def features(self, config: "Config", found: "Tagged", tokenizer
                 ) -> tuple[dict[str, np.ndarray], Any, Optional[list[list[str]]]]:
        from data.labelled import label_ids, token_features

        model, s = config.model, config.model.sequence_length
        ids = [label_ids(tags, model.labels, found.path, lines, what="tag")
               for tags, lines in zip(found.tags, found.tag_lines)]
        arrays = token_features(tokenizer, found.words, ids, s)
        cut = int((arrays["words_kept"] < np.array([len(w) for w in found.words])).sum())
        _say_truncated(cut, len(found.words), found.path, s, "sentences", "words past it are predicted O")
        return arrays, found.tags, found.words

    def figures(self, model: "ModelConfig", rows, logits: np.ndarray) -> tuple[dict, Prediction]:
        from bert.tasks.metrics import entity_scores

        tags = _predicted_tags(model, rows, logits)
        return entity_scores(tags, rows.gold), tags

    def degenerate(self, model: "ModelConfig", rows, predicted: Prediction) -> Optional[str]:
        from bert.tasks.metrics import degenerate_tags

        return degenerate_tags(predicted, rows.gold)

    def predictions(self, model: "ModelConfig", rows, predicted: Prediction) -> tuple[str, list[str]]:
        """conlleval's input: word, gold tag, predicted tag; a blank line after each sentence."""
        lines = []
        for words, gold, tags in zip(rows.words, rows.gold, predicted):
            lines += [f"{w} {g} {t}" for w, g, t in zip(words, gold, tags)] + [""]
        return "predictions.conll", lines

    def served(self, model: "ModelConfig", logits: np.ndarray, top_k: int) -> list[dict]:
        raise ValueError("a tokens model is served by infer.py --task tokens (entities), not --task classify")



class LabelSets(Targets):
    """Any number of labels per row, written in the label column joined by commas (`sports,
    politics`; GoEmotions' form): HF's multi_label_classification. The head has an output
    per label, each a sigmoid: a label is predicted where its logit is above 0 (probability
    0.5); the loss is the binary cross-entropy with logits, the mean over rows and labels
    (torch's BCEWithLogitsLoss, which HF uses)."""

    separator = ","

    def _sets(self, found: "Table") -> list[tuple[str, ...]]:
        sets = []
        for cell, line in zip(found.labels, found.lines):
            names = tuple(sorted({n.strip() for n in cell.split(self.separator)} - {""}))
            if not names:
                raise ValueError(f"{found.path} line {line}: the label cell {cell!r} names no label; give the row's "
                                 f"labels joined by {self.separator!r}, or remove the row")
            sets.append(names)
        return sets

    def names(self, found: "Table") -> tuple[str, ...]:
        return tuple(sorted({n for names in self._sets(found) for n in names}))

    def gold(self, model: "ModelConfig", found: "Table") -> np.ndarray:
        """(N, L) float32: 1 where the row has the label."""
        index = {name: i for i, name in enumerate(model.labels)}
        gold = np.zeros((len(found.labels), len(model.labels)), np.float32)
        for row, (names, line) in enumerate(zip(self._sets(found), found.lines)):
            for name in names:
                if name not in index:
                    raise ValueError(f"{found.path} line {line}: label {name!r} is not among the training file's "
                                     f"labels {list(model.labels)}: the model cannot predict it; fix the label, or "
                                     "add examples of it to the training file")
                gold[row, index[name]] = 1.0
        return gold

    def loss(self, b: "Builder", model: "ModelConfig", logits: "Tensor", shape: list,
             used: Callable[[], "Tensor"]) -> "Tensor":
        """max(x, 0) − x·y + log(1 + e^−|x|) per row and label, the mean; packed, over the
        slots that hold a sequence. Max, not Relu: at x = 0 its gradient is split (torch's
        maximum), so the loss's is σ(0) − y there, as BCEWithLogitsLoss's."""
        from bert.model import flatten
        from builder import FLOAT

        width = model.outputs
        x = flatten(b, logits, (width,))  # (B·N, L)
        y = flatten(b, b.input("labels", [*shape, width], FLOAT), (width,))
        zero, one = b.constant(np.float32(0.0)), b.constant(np.float32(1.0))
        soft = b.onnx.Log(b.onnx.Add(one, b.onnx.Exp(b.onnx.Neg(b.onnx.Abs(x)))))
        each = b.onnx.Add(b.onnx.Sub(b.onnx.Max(x, zero), b.onnx.Mul(x, y)), soft)  # (B·N, L)
        if not model.packed:
            return b.onnx.ReduceMean(each, keepdims=0)
        rows = b.onnx.ReduceSum(each, b.constant(np.array([1], np.int64)), keepdims=0)  # (B·N,)
        return _slot_mean(b, rows, used(), per_slot=width)

    def figures(self, model: "ModelConfig", rows, logits: np.ndarray) -> tuple[dict, Prediction]:
        """`f1` (micro), `f1_macro` (over every label) and `accuracy` (the whole set right), by
        scikit-learn on the label indicators (zero_division 0); the predictions (N, L) 0/1."""
        import sklearn.metrics

        predicted, gold = (logits > 0).astype(np.int64), np.asarray(rows.gold).astype(np.int64)
        return {"f1": float(sklearn.metrics.f1_score(gold, predicted, average="micro", zero_division=0)),
                "f1_macro": float(sklearn.metrics.f1_score(gold, predicted, average="macro", zero_division=0)),
                "accuracy": float(sklearn.metrics.accuracy_score(gold, predicted))}, predicted

    def degenerate(self, model: "ModelConfig", rows, predicted: Prediction) -> Optional[str]:
        """One label set for every row, or fewer sets right than always answering the dev
        set's most frequent set."""
        predicted, gold = np.asarray(predicted), np.asarray(rows.gold).astype(np.int64)
        if len(predicted) > 1 and (predicted == predicted[0]).all():
            return f"predicts one label set ({self._joined(model, predicted[0])!r}) for all {len(predicted):,} dev rows"
        sets, counts = np.unique(gold, axis=0, return_counts=True)
        majority, accuracy = counts.max() / len(gold), float((predicted == gold).all(axis=1).mean())
        if accuracy < majority:
            return (f"scores accuracy {accuracy:.4f} (whole sets), below always answering the dev set's most frequent "
                    f"set ({self._joined(model, sets[counts.argmax()])!r}, {majority:.4f})")
        return None

    def _joined(self, model: "ModelConfig", row: np.ndarray) -> str:
        """A row's labels (its 0/1 indicators) as the label column writes them."""
        return self.separator.join(model.labels[i] for i in np.flatnonzero(row))

    def predictions(self, model: "ModelConfig", rows, predicted: Prediction) -> tuple[str, list[str]]:
        """A row's labels joined by commas (an empty field: none predicted)."""
        return "predictions.tsv", ["line\tprediction\tlabel"] + [
            f"{n}\t{self._joined(model, p)}\t{self._joined(model, g)}"
            for n, p, g in zip(rows.lines, predicted, rows.gold)]

    def probabilities(self, logits: np.ndarray) -> np.ndarray:
        """Each label's own sigmoid (served most probable first; a label is predicted above 0.5)."""
        return 1.0 / (1.0 + np.exp(-logits.astype(np.float64)))

def _predicted_tags(model: "ModelConfig", rows, logits: np.ndarray) -> list[list[str]]:
    """Each sentence's tag per word: the argmax at its first sub-word; a word without one
    (past the sequence, or no sub-word at all) is O."""
    found = []
    best = logits.argmax(-1)  # (N, S)
    for i, words in enumerate(rows.words):
        tags = ["O"] * len(words)
        at = np.nonzero(rows.arrays["word_index"][i] >= 0)[0]
        for position in at:
            tags[int(rows.arrays["word_index"][i, position])] = model.labels[int(best[i, position])]
        found.append(tags)
    return found


def _slot_mean(b: "Builder", values: "Tensor", mask: "Tensor", per_slot: int = 1) -> "Tensor":
    """The mean of (B·N,) `values` over the packed slots that hold a sequence (`mask` 1), each
    slot a sum of `per_slot` terms."""
    count = b.onnx.Max(b.onnx.ReduceSum(mask, keepdims=0), b.constant(np.float32(1.0)))
    if per_slot != 1:
        count = b.onnx.Mul(count, b.constant(np.float32(per_slot)))
    return b.onnx.Div(b.onnx.ReduceSum(b.onnx.Mul(values, mask), keepdims=0), count)


def _check_file_labels(found: Union["Table", "Tagged"], names: tuple[str, ...], what: str) -> None:
    """A training file a classifier cannot learn from is refused: fewer than two labels (a
    one-class head reports accuracy 1), or labels that are real numbers (a class per value,
    where regression was meant)."""
    if len(names) < 2:
        rows = len(found.tags) if hasattr(found, "tags") else len(found.labels)
        raise ValueError(f"{found.path} has one {what[:-1]} ({names[0]!r} in all {rows:,} rows): a classifier needs "
                         f"at least two; give examples of another {what[:-1]}, or set model.task regression for "
                         "numeric targets")
    fractional = [n for n in names if _fractional(n)]
    if fractional and all(_fractional(n) is not None for n in names):
        raise ValueError(f"{found.path}: the {len(names)} {what} are numbers, {len(fractional)} of them fractional "
                         f"(e.g. {fractional[0]!r}): a classifier would make a class of each value; set model.task "
                         "regression to predict the number, or give class labels")


def _fractional(label: str) -> Optional[bool]:
    """Whether a label is a number with a fractional part; None: not a finite number."""
    try:
        value = float(label)
    except ValueError:
        return None
    return (value != int(value)) if math.isfinite(value) else None


def _say_truncated(count: int, total: int, path: str, length: int, what: str, how: str) -> None:
    if count:
        print(f"note: {count} of {total} {what} of {path} are longer than model.sequence_length {length} and are "
              f"truncated ({how})", flush=True)


def softmax(logits: np.ndarray) -> np.ndarray:
    """Probabilities over the last axis (numerically stable)."""
    e = np.exp(logits - logits.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)
