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

from replayrl.rollout.tasks.environment import Reset  # noqa: E402

retrieval = load_environment_module("retrieval")


class CorpusRetrievalEnv(retrieval.RetrievalEnv):
    """examples/environments/retrieval.py's ``search`` tool (schema, BM25, top-k, answers) over
    the corpus of the episode's prompt."""

    async def reset(self, prompt) -> Reset:
        """Take the corpus path from the prompt's ``metadata.corpus``.

        Raises:
            KeyError: the prompt has no ``metadata.corpus`` (the trajectory ends, named).
        """
        self.corpus = str(prompt.metadata["corpus"])
        return Reset(tuple(self.tools))
