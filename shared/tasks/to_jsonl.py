"""Turn a local GSM8K- or MATH-style dataset file into the JSONL the jsonl task reads.

    python -m shared.tasks.to_jsonl train.parquet gsm8k_train.jsonl
    python -m shared.tasks.to_jsonl math_train.jsonl math_train_qerl.jsonl

Input: a JSONL file, or a parquet file (needs pyarrow) such as the GSM8K dataset's own
`main/train-*.parquet`. Each record's question is its `question` (GSM8K) or `problem` (MATH)
field, its answer its `answer` or `solution` field (`--question-field`/`--answer-field` name
others). Output: one {"question", "answer"} line per record. Reads the local file only: qerl
never downloads data.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator
from pathlib import Path

from shared.errors import QerlError, read_utf8

QUESTION_FIELDS = ("question", "problem")
ANSWER_FIELDS = ("answer", "solution")


def read_records(path: Path) -> Iterator[dict]:
    if not path.is_file():
        raise QerlError(f"dataset file not found: {path}")
    if path.suffix == ".parquet":
        try:
            import pyarrow.parquet as parquet
        except ImportError:
            raise QerlError(f"{path}: reading parquet needs pyarrow (pip install pyarrow)") from None
        yield from parquet.read_table(path).to_pylist()
        return
    for number, line in enumerate(read_utf8(path).splitlines(), start=1):
        if line.strip():
            try:
                yield json.loads(line)
            except json.JSONDecodeError as error:
                raise QerlError(f"{path}:{number}: not valid JSON ({error.msg})") from None


def _field(record: dict, names: tuple[str, ...], where: str) -> str:
    for name in names:
        if isinstance(record, dict) and isinstance(record.get(name), (str, int, float)):
            return str(record[name])
    raise QerlError(f"{where}: no {' or '.join(repr(n) for n in names)} field")


def convert(source: Path, target: Path, question_fields: tuple[str, ...] = QUESTION_FIELDS,
            answer_fields: tuple[str, ...] = ANSWER_FIELDS) -> int:
    """Writes `target` (atomically) and returns the number of records."""
    lines = []
    for number, record in enumerate(read_records(source), start=1):
        where = f"{source} record {number}"
        lines.append(json.dumps({"question": _field(record, question_fields, where),
                                 "answer": _field(record, answer_fields, where)}) + "\n")
    if not lines:
        raise QerlError(f"{source} has no records")
    partial = target.with_name(target.name + ".partial")
    partial.write_text("".join(lines))
    partial.replace(target)
    return len(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m shared.tasks.to_jsonl", description=__doc__.splitlines()[0])
    parser.add_argument("source", type=Path)
    parser.add_argument("target", type=Path)
    parser.add_argument("--question-field", default=None, help="the question's field (default: question or problem)")
    parser.add_argument("--answer-field", default=None, help="the answer's field (default: answer or solution)")
    args = parser.parse_args(argv)
    try:
        count = convert(args.source, args.target,
                        (args.question_field,) if args.question_field else QUESTION_FIELDS,
                        (args.answer_field,) if args.answer_field else ANSWER_FIELDS)
    except QerlError as error:
        print(f"error: {error}")
        return 2
    print(f"[qerl] wrote {count} problems to {args.target}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
