"""Questions only a local corpus answers: facts about invented places, answered with BM25
search over that corpus (examples/agentic/corpus_retrieval.py, the search tool of
examples/environments/retrieval.py).

    python examples/agentic/make_retrieval.py /tmp/agentic/retrieval [--places 96 --sft 256 --seed 0]

Writes ``corpus.txt`` (two facts per invented place, one a line: its capital and its founding
year; the names are made of random syllables, so no policy knows them), ``sft.jsonl``
(demonstrations: search for the question's keywords, copy the answer; the tool's answer is the
environment's own BM25 top passages) and ``rl.jsonl`` (``{"prompt", "label", "metadata":
{"corpus"}}``, for ``--rm-type exact``). No question is in both files: the places are split.
"""
from __future__ import annotations

import argparse
import random
from pathlib import Path

from common import demonstration, load_environment_module, tool_call, write

SYLLABLES = ["ka", "lo", "mir", "ven", "tor", "qua", "zel", "bri", "dun", "sha", "ro", "vek",
             "pal", "nor", "ith", "gar"]
PREFIX = "Use the search tool, then answer with one word or number: "
QUESTIONS = {"capital": ("what is the capital of {place}?", "capital of {place}"),
             "founded": ("in which year was {place} founded?", "{place} founded year")}


def name(rng: random.Random) -> str:
    """A capitalised made-up word of two or three syllables."""
    return "".join(rng.choice(SYLLABLES) for _ in range(rng.choice((2, 3)))).capitalize()


def places(n: int, rng: random.Random) -> list[dict]:
    """``n`` invented places with distinct names: ``{"place", "capital", "founded"}``."""
    out, used = [], set()
    while len(out) < n:
        place, capital = name(rng), name(rng)
        if place in used or capital in used:
            continue
        used |= {place, capital}
        out.append({"place": place, "capital": capital, "founded": str(rng.randint(1100, 1950))})
    return out


def main(argv: list[str] | None = None) -> None:
    """Write the three files (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--places", type=int, default=96, help="invented places (default 96)")
    parser.add_argument("--sft", type=int, default=256, help="demonstrations (default 256)")
    parser.add_argument("--rl-share", type=float, default=0.25,
                        help="the share of places whose questions are RL prompts (default 0.25)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    rng = random.Random(args.seed)
    facts = places(args.places, rng)
    args.out.mkdir(parents=True, exist_ok=True)
    corpus = (args.out / "corpus.txt").resolve()
    corpus.write_text("".join(f"The capital of {f['place']} is {f['capital']}.\n"
                              f"{f['place']} was founded in {f['founded']}.\n" for f in facts))
    retrieval = load_environment_module("retrieval")
    index = retrieval.index(str(corpus))
    cut = max(1, round(len(facts) * args.rl_share))
    held_out, seen = facts[:cut], facts[cut:]
    sft = []
    for _ in range(args.sft):
        fact, kind = rng.choice(seen), rng.choice(sorted(QUESTIONS))
        question, query = (q.format(place=fact["place"]) for q in QUESTIONS[kind])
        observation = "\n".join(index.search(query)) or "no results"  # what the tool answers
        sft.append(demonstration(PREFIX + question, tool_call("search", {"query": query}),
                                 observation, fact[kind], retrieval.TOOLS))
    rl = [{"prompt": PREFIX + QUESTIONS[kind][0].format(place=f["place"]), "label": f[kind],
           "metadata": {"corpus": str(corpus)}} for f in held_out for kind in sorted(QUESTIONS)]
    write(args.out, sft, rl)


if __name__ == "__main__":
    main()
