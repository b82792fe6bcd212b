"""``python -m ddtree chat``: talk to the target, decoded by DDTree, the text streamed as each round commits.

Multi-turn through the tokenizer's chat template. After each reply one short
line gives the tokens, the tokens per verify round (the speculative gain) and
tokens/s. Commands: ``/budget N`` (``/budget 0`` is plain decoding, to compare),
``/builder NAME`` (best_first, chain, beam@WxD, module:function), ``/reset``
(forget the conversation), ``/quit``. End of input (Ctrl-D) exits.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import TextIO

import torch

from ddtree.generation.inputs import resolve_generation, streamed

EXAMPLES = [
    "python -m ddtree chat",
    "python -m ddtree chat --budget 8 --builder chain --max-new-tokens 128",
    "python -m ddtree chat --temperature 0.7 --top-p 0.9 --seed 1",
]
HELP_LINE = "commands: /budget N, /builder NAME, /reset, /quit; end of input (Ctrl-D) exits"


def build_parser() -> argparse.ArgumentParser:
    from ddtree.apps.cli import parser

    ap = parser("python -m ddtree chat", __doc__, EXAMPLES)
    ap.add_argument("--target", default=None, help="target model directory (None: the default SmolLM2 pair)")
    ap.add_argument("--drafter", default=None, help="DFlash drafter directory for --target")
    ap.add_argument("--budget", default="auto", help="tree budget: 'auto' (the default) or draft nodes per round")
    ap.add_argument("--builder", default="best_first",
                    help="tree builder: best_first, chain, beam@WxD, module:function")
    ap.add_argument("--max-new-tokens", type=int, default=256, help="longest reply, in tokens")
    ap.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    ap.add_argument("--top-k", type=int, default=None, help="top-k filter when sampling (None: off)")
    ap.add_argument("--top-p", type=float, default=None, help="top-p filter when sampling (None: off)")
    ap.add_argument("--seed", type=int, default=None, help="sampling seed (None: a fresh one per reply)")
    ap.add_argument("--system", default=None, help="a system message opening the conversation")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="model dtype")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch CPU threads (None: OMP_NUM_THREADS, else the free physical cores)")
    return ap


class _Printer:
    """A transformers ``TextStreamer`` that writes to ``out`` (the prompt skipped, special tokens hidden)."""

    def __new__(cls, tokenizer, out: TextIO):
        from transformers import TextStreamer

        class Printer(TextStreamer):
            def on_finalized_text(self, text: str, stream_end: bool = False) -> None:
                out.write(text + ("\n" if stream_end else ""))
                out.flush()

        return Printer(tokenizer, skip_prompt=True, skip_special_tokens=True)


def parse_budget(text: str) -> int | str:
    if text == "auto":
        return "auto"
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise ValueError(f"the budget is an int >= 0 or 'auto', got {text!r}")
    return value


def encode(tokenizer, messages: list[dict]) -> torch.Tensor:
    """The conversation as ``[1, T]`` ids, through the chat template (or plain turns without one)."""
    if getattr(tokenizer, "chat_template", None):
        enc = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                            return_dict=True)
        return enc["input_ids"]
    text = "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"
    return tokenizer(text, return_tensors="pt")["input_ids"]


def stop_ids(gen, tokenizer) -> tuple[int, ...]:
    """The target's end-of-sequence ids (all of them) and the tokenizer's end-of-turn token."""
    stops = set(resolve_generation(target_generation_config=gen.target.generation_config,
                                   max_new_tokens=1).stop_token_ids)
    if tokenizer.eos_token_id is not None:
        stops.add(int(tokenizer.eos_token_id))
    return tuple(sorted(stops))


def run_chat(args: argparse.Namespace, stdin: TextIO, stdout: TextIO) -> int:
    from ddtree.core.builders import resolve_builder
    from ddtree.generation.generator import SpeculativeGenerator
    from ddtree.runtime.threads import configure_threads

    threads = configure_threads(args.threads, fix="python -m ddtree chat --threads 1, or OMP_NUM_THREADS=1")
    if (args.target is None) != (args.drafter is None):
        raise SystemExit("give --target and --drafter together (or neither, for the default pair)")
    budget = parse_budget(args.budget)
    stdout.write(f"loading {'the default pair' if args.target is None else args.target} ...\n")
    stdout.flush()
    gen = SpeculativeGenerator.from_pretrained(args.target, args.drafter, dtype=getattr(torch, args.dtype),
                                               builder=args.builder)
    tok = gen.tokenizer
    if tok is None:
        raise SystemExit(f"chat needs a tokenizer in the target directory {args.target}")
    stops = stop_ids(gen, tok)
    builder_name = args.builder  # per call, like the budget: the generator keeps its own
    stdout.write(f"{threads.describe()}\n{HELP_LINE}\n")
    messages: list[dict] = [{"role": "system", "content": args.system}] if args.system else []
    while True:
        stdout.write("> ")
        stdout.flush()
        line = stdin.readline()
        if not line:
            stdout.write("\n")
            return 0
        text = line.strip()
        if not text:
            continue
        if text.startswith("/"):
            command, _, value = text.partition(" ")
            try:
                if command == "/budget":
                    budget = parse_budget(value.strip())
                    stdout.write(f"budget {budget}\n")
                elif command == "/builder":
                    resolve_builder(value.strip())  # refused here, with its fix, before the next reply
                    builder_name = value.strip()
                    stdout.write(f"builder {builder_name}\n")
                elif command == "/reset":
                    messages = messages[:1] if args.system else []
                    stdout.write("conversation cleared\n")
                elif command in ("/quit", "/exit"):
                    return 0
                else:
                    stdout.write(f"unknown command {command}; {HELP_LINE}\n")
            except (ValueError, ImportError, AttributeError) as exc:
                stdout.write(f"{exc}\n")
            continue
        messages.append({"role": "user", "content": text})
        ids = encode(tok, messages)
        t0 = time.perf_counter()
        chunks = gen.stream(ids, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                            top_k=args.top_k, top_p=args.top_p, stop_token_ids=stops, tree_budget=budget,
                            builder=builder_name, seed=args.seed)
        reply: list[int] = []
        rounds = 0
        for (chunk,) in streamed(chunks, _Printer(tok, stdout), prompt=ids):  # one row
            reply.extend(chunk)
            rounds += 1
        seconds = time.perf_counter() - t0
        messages.append({"role": "assistant", "content": tok.decode(reply, skip_special_tokens=True)})
        per_round = (len(reply) - 1) / (rounds - 1) if rounds > 1 else 1.0  # the first token comes from prefill
        stdout.write(f"[{len(reply)} tokens, {per_round:.2f} per round, {len(reply) / seconds:.1f} tok/s, "
                     f"budget {budget}, {builder_name}]\n")


def main(argv: list[str] | None = None, stdin: TextIO | None = None, stdout: TextIO | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return run_chat(args, stdin or sys.stdin, stdout or sys.stdout)
    except KeyboardInterrupt:
        return 0


if __name__ == "__main__":
    sys.exit(main())
