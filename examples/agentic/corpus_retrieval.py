"""BM25 retrieval over a corpus named by each prompt (``--env
examples/agentic/corpus_retrieval.py:CorpusRetrievalEnv``): the search tool of
examples/environments/retrieval.py, over the corpus file in the prompt's ``metadata.corpus``
(what examples/agentic/make_retrieval.py writes) instead of examples/environments/corpus.txt.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # --env loads this file by its path

from common import load_environment_module  # noqa: E402

from replayrl.rollout.tasks.environment import Reset, Step, ToolEnvironment, Turn, tool_result  # noqa: E402

retrieval = load_environment_module("retrieval")


class CorpusRetrievalEnv(ToolEnvironment):
    """The ``search`` tool (examples/environments/retrieval.py's schema, BM25 and top-k) over
    the corpus of the episode's prompt."""

    tools = retrieval.TOOLS

    async def reset(self, prompt) -> Reset:
        """Take the corpus path from the prompt's ``metadata.corpus``.

        Raises:
            KeyError: the prompt has no ``metadata.corpus`` (the trajectory ends, named).
        """
        self.corpus = str(prompt.metadata["corpus"])
        return Reset(tuple(self.tools))

    async def step(self, turn: Turn) -> Step:
        """Answer every ``search`` call of the turn; no call = the final answer."""
        if not turn.tool_calls:
            return Step(done=True)
        answers = []
        for call in turn.tool_calls:
            if call.error or call.name != "search":
                answers.append(tool_result(call, f"error: unknown tool {call.name!r}"))
                continue
            hits = retrieval.index(self.corpus).search(str(call.arguments.get("query", "")))
            answers.append("\n".join(hits) if hits else "no results")
        return Step(observation="\n".join(answers))
