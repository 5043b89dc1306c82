"""Reading SQuAD files: their structure checked, answers aligned to their contexts (see the
package docstring)."""
from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class Example:
    qas_id: str
    question: str
    context: str
    answers: tuple[str, ...]  # all gold answer texts (none: unanswerable or ungraded)
    answer_starts: tuple[int | None, ...]  # character offsets in `context` (None: text not found)
    title: str = ""
    is_impossible: bool = False  # SQuAD v2.0: the context holds no answer
    graded: bool = True  # False: asked without gold answers (served, not scored)
    # Character ends (exclusive) of the located answers; empty: start + len(text).
    answer_ends: tuple[int | None, ...] = ()

    @property
    def answer_span(self) -> tuple[int, int] | None:
        """(start, end) characters of the first gold answer in the context, if located."""
        if not self.answers or self.answer_starts[0] is None:
            return None
        start = self.answer_starts[0]
        end = self.answer_ends[0] if self.answer_ends else None
        return start, (start + len(self.answers[0]) if end is None else end)


@dataclass
class Feature:
    unique_id: int
    example_index: int
    window_index: int
    input_ids: list[int]
    input_mask: list[int]
    segment_ids: list[int]
    # For each position: (start, end) character offsets in the example's context,
    # or None for question, special and padding tokens.
    offsets: list[tuple[int, int] | None]
    max_context: list[bool]
    start_position: int = 0
    end_position: int = 0
    extra: dict = field(default_factory=dict)


@dataclass(frozen=True)
class SquadData:
    """What a SQuAD file holds, and what the reader did with it.

    `examples`: every question, in file order. `unanswerable`: ids of SQuAD v2.0
    questions without an answer; `ungraded`: ids asked without gold answers.
    `relocated`: ids whose answer_start was missing, null or wrong and was found by the
    answer text; `realigned`: ids whose answer differs from the context only in white
    space or case, aligned to the context's characters; `unlocated`: ids whose first
    answer text is not in the context (kept for scoring, dropped from training).
    """

    examples: list[Example]
    unanswerable: list[str]
    relocated: list[str]
    unlocated: list[str]
    realigned: list[str] = field(default_factory=list)
    ungraded: list[str] = field(default_factory=list)
    version_2: bool = False  # the file marks questions with is_impossible

    @property
    def answerable(self) -> list[Example]:
        return [e for e in self.examples if e.answers]

    @property
    def trainable(self) -> list[Example]:
        """Examples that give a span to learn: located answers, and v2.0's unanswerable ones."""
        return [e for e in self.examples if e.is_impossible or (e.answers and e.answer_starts[0] is not None)]

    def summary(self, where: str, training: bool = True) -> str:
        """One line: the questions by kind, and the answers kept as written, fixed and dropped
        (from training; a file only scored, `training` False, drops none: it says how many
        answers are not in their context)."""
        kinds = [f"{len(self.answerable)} answerable"]
        if self.unanswerable:
            kinds.append(f"{len(self.unanswerable)} unanswerable (SQuAD v2.0)")
        if self.ungraded:
            kinds.append(f"{len(self.ungraded)} without answers (answered, not scored)")
        fixed = set(self.relocated) | set(self.realigned)
        kept = len(self.answerable) - len(fixed) - len(self.unlocated)
        line = (f"{where}: {len(self.examples)} questions ({', '.join(kinds)}); answers: {kept} kept as written, "
                f"{len(fixed)} fixed ({len(self.relocated)} answer_start missing or wrong, found by the answer text; "
                f"{len(self.realigned)} differing from the context in white space or case, aligned), "
                + (f"{len(self.unlocated)} dropped from training" if training else
                   f"{len(self.unlocated)} not in their context"))
        if self.unlocated:
            shown = ", ".join(self.unlocated[:10]) + (" ..." if len(self.unlocated) > 10 else "")
            line += f" (not in their context; still scored: {shown})" if training else \
                f" (scored all the same: {shown})"
        return line


def read_squad(path: str | Path, verbose: bool = True) -> list[Example]:
    """Every question of a SQuAD v1.1 or v2.0 file; prints what `load_squad` kept, fixed and dropped."""
    data = load_squad(path)
    if verbose:
        print(data.summary(str(path)), flush=True)
    return data.examples


def load_squad(path: str | Path) -> SquadData:
    """Read a SQuAD JSON file (`{"data": [{"paragraphs": ...}]}`) as users have them.

    Offsets are hints: an `answer_start` that is missing, null or a few characters off is
    replaced by the occurrence of the answer text nearest to it (or the first, without a
    hint); white space and case may differ from the context. Every structural fault is a
    ValueError naming the file and where in it.
    """
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"SQuAD file {path} is a directory, not a file; name the SQuAD JSON file in it")
    if not path.is_file():
        raise ValueError(f"SQuAD file {path} does not exist" if not path.exists()
                         else f"SQuAD file {path} is not a file")
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise ValueError(f"SQuAD file {path} cannot be read ({e.strerror})") from None
    if not raw.strip():
        raise ValueError(f"SQuAD file {path} is empty")
    try:
        blob = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        raise ValueError(f"SQuAD file {path}, line {line}: not valid UTF-8") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"SQuAD file {path}, line {e.lineno}: invalid JSON ({e.msg})") from None
    except RecursionError:
        raise ValueError(f"SQuAD file {path}: JSON nested too deeply to be a SQuAD file") from None
    if not isinstance(blob, Mapping) or not isinstance(blob.get("data"), list):
        raise ValueError(f"{path}: not a SQuAD file (no top-level 'data' list)")
    return parse_articles(blob["data"], str(path))


def locate_answer(context: str, text: str, hint: int | None) -> tuple[int, int] | None:
    """(start, end) characters of `text` in `context`, or None if it is not there.

    At `hint` when the text is there (exactly, or with other white space or case);
    otherwise, with a hint, the occurrence nearest to it (exact before loose at equal
    distance); without one, the first exact occurrence, else the first loose one.
    The offset is the annotator's: a loose match at the offset beats an exact one far away.
    """
    words = text.split()
    if not words:
        return None
    if hint is not None and context.startswith(text, hint):
        return hint, hint + len(text)
    exact = [(m.start(), m.end()) for m in re.finditer(re.escape(text), context)]
    if hint is None and exact:
        return exact[0]
    loose = [(m.start(), m.end()) for m in
             re.finditer(r"\s+".join(re.escape(w) for w in words), context, flags=re.IGNORECASE)]
    if hint is None:
        return loose[0] if loose else None
    candidates = [(abs(s - hint), 0, s, e) for s, e in exact] + [(abs(s - hint), 1, s, e) for s, e in loose]
    if not candidates:
        return None
    _, _, start, end = min(candidates)
    return start, end


def parse_articles(articles, where: str) -> SquadData:
    if not isinstance(articles, list):
        raise ValueError(f"{where}: SQuAD data must be a list of articles, got {type(articles).__name__}")
    version_2 = any(isinstance(qa, Mapping) and "is_impossible" in qa
                    for article in articles if isinstance(article, Mapping)
                    for para in _list(article.get("paragraphs"))
                    if isinstance(para, Mapping) for qa in _list(para.get("qas")))
    examples, unanswerable, relocated, unlocated, realigned, ungraded = [], [], [], [], [], []
    places: dict[str, str] = {}  # question id → where it was first
    for a_index, article in enumerate(articles):
        at = f"{where}: data[{a_index}]"
        if not isinstance(article, Mapping):
            raise ValueError(f"{at} is a {_kind(article)}, not an article object "
                             '{"title": ..., "paragraphs": [...]}')
        title = article.get("title", "")
        title = title if isinstance(title, str) else str(title)
        paragraphs = article.get("paragraphs")
        if not isinstance(paragraphs, list):
            raise ValueError(f"{at} ({title!r}) has no 'paragraphs' list (got {_kind(paragraphs)})")
        for p_index, para in enumerate(paragraphs):
            pat = f"{at}, paragraph {p_index}"
            if not isinstance(para, Mapping):
                raise ValueError(f"{pat} is a {_kind(para)}, not an object with 'context' and 'qas'")
            context = para.get("context")
            if not isinstance(context, str):
                raise ValueError(f"{pat} has no 'context' text (got {_kind(context)})")
            qas = para.get("qas", [])
            if not isinstance(qas, list):
                raise ValueError(f"{pat}: 'qas' must be a list of questions, got {_kind(qas)}")
            for q_index, qa in enumerate(qas):
                qat = f"{pat}, question {q_index}"
                if not isinstance(qa, Mapping):
                    raise ValueError(f"{qat} is a {_kind(qa)}, not an object with 'id', 'question' and 'answers'")
                if "id" not in qa or "question" not in qa:
                    raise ValueError(f"{qat} lacks 'id' or 'question'")
                qid, question = qa["id"], qa["question"]
                if isinstance(qid, bool) or not isinstance(qid, (str, int)):
                    raise ValueError(f"{qat}: 'id' must be a string, got {_kind(qid)}")
                if not isinstance(question, str):
                    raise ValueError(f"{qat} (id {qid!r}): 'question' must be text, got {_kind(question)}")
                qid = str(qid)
                place = qat[len(where) + 2:]
                if qid in places:  # predictions and scores are keyed by id: one would silently replace the other
                    raise ValueError(f"{where}: question id {qid!r} is given twice ({places[qid]} and {place}); "
                                     "every question needs its own id: rename or remove one")
                places[qid] = place
                impossible = qa.get("is_impossible", False)
                if not isinstance(impossible, bool):
                    raise ValueError(f"{qat} (id {qid!r}): 'is_impossible' must be true or false, got "
                                     f"{json.dumps(impossible)} ({_kind(impossible)}); write the JSON literal")
                answers = _answers(qa, f"{qat} (id {qid!r})")
                if impossible and answers:
                    raise ValueError(f"{qat} (id {qid!r}) has 'is_impossible': true and answers {answers[:2]}; "
                                     "an unanswerable question has none (SQuAD v2.0 puts them in 'plausible_answers')")
                if impossible or (not answers and version_2 and "answers" in qa):
                    unanswerable.append(qid)
                    examples.append(Example(qid, question, context, (), (), title, is_impossible=True))
                    continue
                if not answers:
                    ungraded.append(qid)
                    examples.append(Example(qid, question, context, (), (), title, graded=False))
                    continue
                texts = tuple(t for t, _ in answers)
                spans = [locate_answer(context, t, h) for t, h in answers]
                starts = tuple(s[0] if s else None for s in spans)
                ends = tuple(s[1] if s else None for s in spans)
                if spans[0] is None:
                    unlocated.append(qid)
                else:
                    if starts[0] != answers[0][1]:
                        relocated.append(qid)
                    if context[starts[0] : ends[0]] != texts[0]:
                        realigned.append(qid)
                examples.append(Example(qid, question, context, texts, starts, title, answer_ends=ends))
    return SquadData(examples, unanswerable, relocated, unlocated, realigned, ungraded, version_2)


def _answers(qa: Mapping, at: str) -> list[tuple[str, int | None]]:
    """(text, offset hint) of each gold answer with text; [] when there are none."""
    answers = qa.get("answers")
    if answers is None:
        return []
    if not isinstance(answers, list):
        raise ValueError(f"{at}: 'answers' must be a list of {{\"text\", \"answer_start\"}} objects, got "
                         f"{_kind(answers)} {_short(answers)}")
    out = []
    for i, answer in enumerate(answers):
        if not isinstance(answer, Mapping):
            raise ValueError(f"{at}: answers[{i}] must be an object {{\"text\", \"answer_start\"}}, got "
                             f"{_kind(answer)} {_short(answer)}")
        text = answer.get("text")
        if text is None:
            continue
        if not isinstance(text, str):
            raise ValueError(f"{at}: answers[{i}]['text'] must be text, got {_kind(text)} {_short(text)}")
        if text.strip():
            out.append((text, _offset(answer.get("answer_start"))))
    return out


def _offset(value) -> int | None:
    """An answer_start as written by other tools: an int, a numeric string, null or absent."""
    if isinstance(value, bool):
        return None
    if isinstance(value, float) and not value.is_integer():
        return None
    try:
        offset = int(value)
    except (TypeError, ValueError, OverflowError):
        return None
    return offset if offset >= 0 else None


def _list(value) -> list:
    return value if isinstance(value, list) else []


def _kind(value) -> str:
    return {dict: "object", list: "list", str: "string", bool: "boolean", type(None): "null",
            int: "number", float: "number"}.get(type(value), type(value).__name__)


def _short(value) -> str:
    text = json.dumps(value, ensure_ascii=False, default=str)
    return text if len(text) <= 60 else text[:57] + "..."
