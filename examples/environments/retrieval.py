"""A retrieval tool over a local text corpus (``--env retrieval``, or
``--env examples/environments/retrieval.py:RetrievalEnv``).

The policy calls ``<tool_call>{"name": "search", "arguments": {"query": "capital of
Australia"}}</tool_call>``; the environment answers with the :data:`TOP_K` best passages of
:data:`CORPUS` (one passage per line, ``examples/environments/corpus.txt``), ranked by BM25
(k1 = 1.5, b = 0.75) computed with numpy; no network, no model. A turn without a call is the
final answer (``done``), scored by the task's verifier (``--rm-type exact`` against the label).
"""
from __future__ import annotations

import re
from functools import lru_cache
from pathlib import Path

import numpy as np

from replayrl.rollout.tasks.environment import Step, ToolEnvironment, Turn, tool_result

CORPUS = Path(__file__).resolve().parent / "corpus.txt"
TOP_K = 2
K1, B = 1.5, 0.75
_WORD = re.compile(r"[a-z0-9]+")

TOOLS = ({"type": "function", "function": {
    "name": "search",
    "description": "Search a small encyclopedia; returns the best matching passages.",
    "parameters": {"type": "object",
                   "properties": {"query": {"type": "string", "description": "keywords"}},
                   "required": ["query"]}}},)


def words(text: str) -> list[str]:
    """Lower-cased alphanumeric words of ``text``."""
    return _WORD.findall(text.lower())


class BM25:
    """BM25 over a list of passages.

    Args:
        passages: ``N >= 1`` strings.
    Raises:
        ValueError: no passages.
    """

    def __init__(self, passages: list[str]) -> None:
        if not passages:
            raise ValueError("BM25 needs at least one passage")
        self.passages = list(passages)
        docs = [words(p) for p in self.passages]
        self.vocab = {w: j for j, w in enumerate(sorted({w for d in docs for w in d}))}
        self.tf = np.zeros((len(docs), len(self.vocab)), np.float64)  # [N, V] term counts
        for i, d in enumerate(docs):
            for w in d:
                self.tf[i, self.vocab[w]] += 1
        self.length = self.tf.sum(axis=1)  # [N]
        df = np.count_nonzero(self.tf, axis=0)  # [V]
        self.idf = np.log(1 + (len(docs) - df + 0.5) / (df + 0.5))  # [V]

    def scores(self, query: str) -> np.ndarray:
        """float64 ``[N]``: each passage's BM25 score for ``query`` (0 for unknown words)."""
        cols = [self.vocab[w] for w in words(query) if w in self.vocab]
        if not cols:
            return np.zeros(len(self.passages))
        tf = self.tf[:, cols]  # [N, Q]
        norm = K1 * (1 - B + B * self.length / self.length.mean())  # [N]
        return (self.idf[cols] * tf * (K1 + 1) / (tf + norm[:, None])).sum(axis=1)

    def search(self, query: str, k: int = TOP_K) -> list[str]:
        """The ``k`` best passages (stable order on ties), those with a score above 0 only."""
        s = self.scores(query)
        order = np.argsort(-s, kind="stable")[:k]
        return [self.passages[i] for i in order if s[i] > 0]


@lru_cache(maxsize=4)
def index(path: str = str(CORPUS)) -> BM25:
    """The BM25 index of a corpus file (one passage per non-empty line), built once."""
    return BM25([line.strip() for line in Path(path).read_text().splitlines() if line.strip()])


class RetrievalEnv(ToolEnvironment):
    """The search tool (see the module docstring) over the corpus file ``corpus``."""

    tools = TOOLS
    corpus: str = str(CORPUS)

    async def step(self, turn: Turn) -> Step:
        """Answer every ``search`` call of the turn; no call = the final answer."""
        if not turn.tool_calls:
            return Step(done=True)
        answers = []
        for call in turn.tool_calls:
            if call.error or call.name != "search":
                answers.append(tool_result(call, f"error: unknown tool {call.name!r}"))
                continue
            hits = index(self.corpus).search(str(call.arguments.get("query", "")))
            answers.append("\n".join(hits) if hits else "no results")
        return Step(observation="\n".join(answers))
