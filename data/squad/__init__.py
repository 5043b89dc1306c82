"""SQuAD v1.1 and v2.0: read the JSON, make features, turn logits into answers, score them.

Reading (`load_squad`) checks the file's structure before it uses it, naming the file and
the place of each fault (an article that is not an object, `answers` that is not a list,
an `is_impossible` that is not true or false), and follows the reference tooling's
leniency where it is sound: answer offsets are hints (a missing, null or misplaced
`answer_start` is found again from the answer text), and an answer that differs from
its context only in white space or case is aligned to the context's characters, as
google-research/bert's `read_squad_examples` aligns whitespace-normalised text. What it
kept, fixed and dropped is counted (`SquadData.summary`).

Questions are of three kinds: answerable (gold answers), unanswerable (SQuAD v2.0:
`is_impossible` true, or empty `answers` in a file that uses `is_impossible`), and
ungraded (no `answers` key, or empty `answers` in a file without `is_impossible`: the
questions a user serves). All three are answered; only graded ones are scored.

Answers are located by character offsets throughout: the `tokenizers` encoding of a
context carries each token's (start, end) span in the original text, so a feature's
gold span is the tokens that cover the answer's characters, and a predicted span is
cut from the original context with the same offsets (no re-alignment heuristics as
in google-research/bert's `get_final_text` are needed).

Feature layout: `[CLS] question [SEP] context window [SEP]` + padding, windows
`doc_stride` tokens apart. A token that appears in several windows is scored only
in the window where it has the most context on both sides (BERT's "max context").
Training features whose window misses the answer, and every window of an unanswerable
question, point at [CLS] (position 0): the null answer of SQuAD v2.0. Each distinct
context is tokenized once, and the windows and their max-context flags are computed
once per (context, question length) in time linear in the context's length.

Scoring follows the official evaluation scripts. v1.1 (`evaluate-v1.1.py`): answers
normalised (lower case, punctuation removed, articles a/an/the removed, white space
collapsed); exact match and token-level F1 take the maximum over the gold answers and
are averaged over all questions (×100), reported as `exact_match` and `f1`. v2.0
(`evaluate-v2.0.py`), for files with unanswerable questions: the same normalisation,
an unanswerable question's gold is the empty answer, F1 of two token lists one of
which is empty is 1 if both are, and the figures are `exact`, `f1`, `total`,
`HasAns_exact`, `HasAns_f1`, `HasAns_total`, `NoAns_exact`, `NoAns_f1`, `NoAns_total`;
given the no-answer probabilities (here the null score minus the best span score),
`best_exact`, `best_exact_thresh`, `best_f1`, `best_f1_thresh` as the script's threshold
search computes them. A question without a prediction scores 0.

From logits to scores is one path (`answer_questions`), whichever runtime made the
logits: fine-tuning's evaluation (the session) and infer.py (onnxruntime) both call it.
On a v2.0 dev set it picks the operating null threshold, the one with the best F1 on the
odds the model produces (`operating_null_threshold`: answering nothing and answering
everything included), rather than the official search's `best_f1_thresh`, which falls
back to its start value 0.0 (a probability's floor) when answering nothing is best:
on log-odds that threshold can answer almost every question.
"""
from data.squad.answers import (Answers, Prediction, answer_questions, apply_null_threshold, nbest_predictions,
                               operating_null_threshold, postprocess, span_logits)
from data.squad.features import convert_examples_to_features, feature_arrays
from data.squad.reading import Example, Feature, SquadData, load_squad, locate_answer, read_squad
from data.squad.scoring import best_null_threshold, evaluate, exact_match_score, f1_score, f1_score_v2, normalize_answer

__all__ = [
    "Example",
    "Feature",
    "Prediction",
    "SquadData",
    "load_squad",
    "locate_answer",
    "read_squad",
    "convert_examples_to_features",
    "feature_arrays",
    "Answers",
    "span_logits",
    "nbest_predictions",
    "postprocess",
    "apply_null_threshold",
    "answer_questions",
    "operating_null_threshold",
    "evaluate",
    "best_null_threshold",
    "normalize_answer",
    "exact_match_score",
    "f1_score",
    "f1_score_v2",
]
