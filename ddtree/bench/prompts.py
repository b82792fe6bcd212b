"""The bench's prompt set: a JSONL file of chat prompts (or token ids), tokenized as the target expects."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

DEFAULT_PROMPTS = Path(__file__).resolve().parent.parent / "data" / "prompts.jsonl"


@dataclass
class Prompt:
    id: str
    input_ids: list[int]
    category: str = ""


def load_prompts(path: str | Path | None, tokenizer=None, vocab_size: int | None = None,
                 limit: int | None = None, per_category: int | None = None) -> list[Prompt]:
    """JSONL rows with ``messages`` (chat template), ``prompt`` (plain text) or ``input_ids``.

    ``per_category`` keeps the first N rows of each ``category`` (a cheap spread over
    the kinds of text). Without a tokenizer, text falls back to UTF-8 bytes modulo the
    vocabulary, enough to drive a tokenizer-less (random test) target.
    """
    path = Path(path) if path is not None else DEFAULT_PROMPTS
    prompts = []
    seen: dict[str, int] = {}
    for i, line in enumerate(path.read_text().splitlines()):
        if not line.strip():
            continue
        row = json.loads(line)
        if per_category is not None:
            cat = str(row.get("category", ""))
            seen[cat] = seen.get(cat, 0) + 1
            if seen[cat] > per_category:
                continue
        pid = str(row.get("id", i))
        if "input_ids" in row:
            ids = [int(t) for t in row["input_ids"]]
        elif "messages" in row or "prompt" in row:
            ids = encode_row(row, tokenizer, vocab_size)
        else:
            raise ValueError(f"{path}:{i + 1}: a prompt row needs 'messages', 'prompt' or 'input_ids'")
        if not ids:
            raise ValueError(
                f"{path}:{i + 1}: prompt {pid!r} is empty after tokenization"
                + (" (the target's tokenizer encoded its text to no tokens: the target directory probably lacks "
                   "its tokenizer files, e.g. tokenizer.json; copy them there)" if tokenizer is not None
                   else ": give at least one token")
            )
        prompts.append(Prompt(pid, ids, str(row.get("category", ""))))
        if limit is not None and len(prompts) >= limit:
            break
    if not prompts:
        raise ValueError(f"no prompts in {path}")
    return prompts


def encode_row(row: dict, tokenizer, vocab_size: int | None) -> list[int]:
    """One prompt row's ids: ``messages`` through the chat template, or plain text."""
    if tokenizer is not None:
        if "messages" in row and getattr(tokenizer, "chat_template", None):
            text = tokenizer.apply_chat_template(row["messages"], tokenize=False, add_generation_prompt=True)
            return list(tokenizer(text, add_special_tokens=False).input_ids)
        text = row.get("prompt") or "\n".join(m["content"] for m in row["messages"])
        return list(tokenizer(text).input_ids)
    if vocab_size is None:
        raise ValueError("text prompts need a tokenizer (or a vocabulary size for the byte fallback)")
    text = row.get("prompt") or "\n".join(m["content"] for m in row["messages"])
    return [b % vocab_size for b in text.encode("utf-8")] or [0]
