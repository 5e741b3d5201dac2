"""The conversations of ``replayrl sft``: rows read from JSONL / Parquet files, rendered with
the checkpoint's chat template, bad rows refused or skipped.

A row is an object with ``messages`` (TRL's conversational format:
:mod:`replayrl.rollout.text.conversation`) and optionally ``tools`` (the tool schema the
template renders). Files are read as prompt files are
(:func:`replayrl.rollout.text.prompt_data.raw_rows`: a JSONL line or 1-based Parquet row is
named ``FILE:LINE``).
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from replayrl.rollout.errors import PromptDataError
from replayrl.rollout.text.conversation import Conversation, ConversationError, render_conversation
from replayrl.rollout.text.prompt_data import raw_rows
from replayrl.rollout.text.tokenizer import PromptTokenizer

__all__ = ["SFTData", "load_conversations"]


@dataclass(frozen=True)
class SFTData:
    """The conversations to train on and the rows left out.

    Attributes:
        conversations: the rendered rows, in file then line order.
        sources: ``"FILE:LINE"`` of each conversation.
        skipped: ``(FILE:LINE, message)`` of every row skipped (``--skip-bad-rows``).
        skipped_by_reason: reason (:attr:`ConversationError.reason`) -> rows skipped for it.
    """

    conversations: tuple[Conversation, ...]
    sources: tuple[str, ...]
    skipped: tuple[tuple[str, str], ...]
    skipped_by_reason: dict[str, int]


def load_conversations(files: Sequence[str | Path], tokenizer: PromptTokenizer, *,
                       max_length: int, vocab_size: int, skip_bad_rows: bool) -> SFTData:
    """Read, check and render every row of ``files``.

    Args:
        tokenizer: the checkpoint's tokenizer with its chat template.
        max_length: the most tokens of one rendered conversation.
        vocab_size: the policy's vocabulary; a token id at or past it is a bad row.
        skip_bad_rows: skip a bad row (named in :attr:`SFTData.skipped`, counted by reason)
            instead of raising.

    Raises:
        ConversationError: the first bad row (``FILE:LINE``, what is wrong), without
            ``skip_bad_rows``: not an object, no ``messages``, a malformed message, an unknown
            role, no assistant message, too long, a token outside the vocabulary, or
            ``tools`` that is not a list of objects.
        PromptDataError: a missing or unreadable file, a line that is not JSON, or no row
            left to train on.
    """
    conversations, sources, skipped = [], [], []
    reasons: Counter[str] = Counter()
    for file in files:
        for line, raw in raw_rows(Path(file)):
            where = f"{file}:{line}"
            try:
                conversations.append(_render(raw, where, tokenizer, max_length, vocab_size))
                sources.append(where)
            except ConversationError as exc:
                if not skip_bad_rows:
                    raise
                skipped.append((where, str(exc)))
                reasons[exc.reason] += 1
    if not conversations:
        raise PromptDataError(f"no conversation to train on in {', '.join(map(str, files))}"
                              + (f" ({len(skipped)} bad rows skipped)" if skipped else ""))
    return SFTData(tuple(conversations), tuple(sources), tuple(skipped), dict(reasons))


def _render(raw, where: str, tokenizer: PromptTokenizer, max_length: int,
            vocab_size: int) -> Conversation:
    """One row rendered; ConversationError naming ``where``."""
    if not isinstance(raw, dict) or "messages" not in raw:
        raise ConversationError("malformed", f"{where}: a row must be an object with 'messages', "
                                             f"got {raw!r:.80}")
    tools = raw.get("tools")
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise ConversationError("malformed", f"{where}: 'tools' must be a list of objects, "
                                             f"got {tools!r:.80}")
    conversation = render_conversation(tokenizer, raw["messages"], max_length=max_length,
                                       tools=tools or None, where=where)
    top = max(int(conversation.prompt_ids.max()), int(conversation.response_ids.max()))
    if top >= vocab_size:
        raise ConversationError("vocabulary", f"{where}: token id {top} is outside the policy's "
                                              f"vocabulary of {vocab_size}")
    return conversation
