"""Questions only a local corpus answers: facts about invented places, answered with BM25
search over that corpus (examples/agentic/corpus_retrieval.py, the search tool of
examples/environments/retrieval.py).

    python examples/agentic/make_retrieval.py /tmp/agentic/retrieval [--places 96 --sft 256 --seed 0]

Writes ``corpus.txt`` (two facts per invented place, one a line, in one pattern: ``The capital
of X is Y.`` and ``The founding year of X is 1234.``), ``sft.jsonl`` (demonstrations: search for
the question's own words ``capital of X`` / ``founding year of X``, copy the answer; the tool's
answer is the environment's own BM25 top passages) and ``rl.jsonl`` (``{"prompt", "label",
"metadata": {"corpus"}}``, for ``--rm-type exact``). The places are split: no question, and no
fact of an RL place, is in a demonstration.

The names are made up, so no policy knows them. ``--names letters`` (default) spells each with
four distinct capital letters (``QVEK``), which the example checkpoint's character-level
tokenizer makes four tokens the rest of the prompt hardly uses, so copying the name is a
look-up of the next character; ``--names syllables`` joins two or three syllables (``Torvekmir``),
whose letters recur across the prompt and within the name.

``--no-tool`` writes the baseline's demonstrations instead: the question answered at once, no
tool call and no tool schema; ``rl.jsonl`` is the same as without it (same ``--seed``).
"""
from __future__ import annotations

import argparse
import random
import string
from pathlib import Path

from common import demonstration, direct_answer, load_environment_module, tool_call, write

SYLLABLES = ["ka", "lo", "mir", "ven", "tor", "qua", "zel", "bri", "dun", "sha", "ro", "vek",
             "pal", "nor", "ith", "gar"]
PREFIX = "Use the search tool, then answer with one word or number: "
ATTRIBUTES = {"capital": "capital", "founded": "founding year"}  # fact -> its words


def name(rng: random.Random, style: str) -> str:
    """A made-up name: four distinct capital letters (``letters``) or a capitalised word of two
    or three syllables (``syllables``)."""
    if style == "letters":
        return "".join(rng.sample(string.ascii_uppercase, 4))
    return "".join(rng.choice(SYLLABLES) for _ in range(rng.choice((2, 3)))).capitalize()


def places(n: int, rng: random.Random, style: str = "letters") -> list[dict]:
    """``n`` invented places with distinct names: ``{"place", "capital", "founded"}``."""
    out, used = [], set()
    while len(out) < n:
        place, capital = name(rng, style), name(rng, style)
        if place in used or capital in used or place == capital:
            continue
        used |= {place, capital}
        out.append({"place": place, "capital": capital, "founded": str(rng.randint(1100, 1950))})
    return out


def question(fact: dict, kind: str) -> tuple[str, str]:
    """The question about ``fact[kind]`` and the search query, the question's own words."""
    query = f"{ATTRIBUTES[kind]} of {fact['place']}"
    return f"{PREFIX}what is the {query}?", query


def main(argv: list[str] | None = None) -> None:
    """Write the three files (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--places", type=int, default=96, help="invented places (default 96)")
    parser.add_argument("--sft", type=int, default=256, help="demonstrations (default 256)")
    parser.add_argument("--rl-share", type=float, default=0.25,
                        help="the share of places whose questions are RL prompts (default 0.25)")
    parser.add_argument("--names", choices=("letters", "syllables"), default="letters",
                        help="how names are spelt (default letters; see the module docstring)")
    parser.add_argument("--no-tool", action="store_true",
                        help="demonstrations that answer without the tool (the baseline)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    rng = random.Random(args.seed)
    facts = places(args.places, rng, args.names)
    args.out.mkdir(parents=True, exist_ok=True)
    corpus = (args.out / "corpus.txt").resolve()
    corpus.write_text("".join(f"The {ATTRIBUTES[k]} of {f['place']} is {f[k]}.\n"
                              for f in facts for k in ATTRIBUTES))
    retrieval = load_environment_module("retrieval")
    index = retrieval.index(str(corpus))
    cut = max(1, round(len(facts) * args.rl_share))
    held_out, seen = facts[:cut], facts[cut:]
    sft = []
    for _ in range(args.sft):
        fact, kind = rng.choice(seen), rng.choice(sorted(ATTRIBUTES))
        text, query = question(fact, kind)
        if args.no_tool:
            sft.append(direct_answer(text, fact[kind]))
            continue
        observation = "\n".join(index.search(query)) or "no results"  # what the tool answers
        sft.append(demonstration(text, tool_call("search", {"query": query}),
                                 observation, fact[kind], retrieval.TOOLS))
    rl = [{"prompt": question(f, kind)[0], "label": f[kind], "metadata": {"corpus": str(corpus)}}
          for f in held_out for kind in sorted(ATTRIBUTES)]
    write(args.out, sft, rl)


if __name__ == "__main__":
    main()
