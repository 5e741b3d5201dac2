"""Chat conversations as training rows: rendered by the chat template, loss on the assistant's
tokens only (``replayrl sft``, docs/sft.md).

A conversation is a list of messages in TRL's conversational format: ``{"role", "content"}``
with the roles ``system``, ``user``, ``assistant`` and ``tool``; an assistant message may carry
``tool_calls`` (and ``content`` may then be empty or absent), which the template renders.
:func:`render_conversation` cuts the template's text of the whole conversation into the pieces a
multi-turn rollout is made of, and tokenises each piece alone, as the turn loop does
(:mod:`replayrl.rollout.episodes.turn_loop`, ``PromptTokenizer.render_tool_text``):

* the prompt: the messages before the first assistant message with the generation prompt,
  ``render(messages[:k], add_generation_prompt=True)`` -- what ``encode_prompt`` gives a
  rollout (loss mask 0);
* each assistant turn: what the template adds for the message, ``render(messages[:k+1])``
  minus ``render(messages[:k], add_generation_prompt=True)``, up to and including the
  end-of-turn token that starts the template's closing of a turn (e.g. ``<|im_end|>``): what the
  engine generates, stop token included (loss mask 1);
* everything between two assistant turns: the rest of the closing (e.g. ``"\\n"``), the tool
  responses or user messages and the next generation prompt -- what a rollout appends as an
  observation (loss mask 0).

So the mask is the one RL trains under (generated tokens 1, prompt and observations 0), and
it is what TRL's ``assistant_only_loss`` computes from a template's ``{% generation %}``
markers (the assistant's output up to and including its end-of-turn token), without needing
the markers. Messages after the last assistant message carry no loss and are left out. A
template that rewrites earlier text when a message is added (the pieces would not join into
the whole conversation) is refused rather than trained on text no rollout produces.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np

from replayrl.rollout.errors import ConversationError
from replayrl.rollout.text.tokenizer import PromptTokenizer

__all__ = ["ROLES", "ConversationError", "Conversation", "render_conversation", "turn_closing"]

ROLES = ("system", "user", "assistant", "tool")
"""The message roles a conversation may hold (TRL's conversational format)."""

# the assistant content rendered in a fixed two-message conversation to find the text a
# template closes a turn with: a marker no template writes itself
_MARKER = "replayrl-assistant-turn"


@dataclass(frozen=True)
class Conversation:
    """One rendered conversation: a prompt and a response, as a rollout's sample holds them.

    Attributes:
        prompt_ids: int32 ``[P]``, ``P >= 1``: the messages before the first assistant message
            with the generation prompt.
        response_ids: int32 ``[R]``, ``R >= 1``: every assistant turn and what lies between them.
        loss_mask: uint8 ``[R]``: 1 on the assistant turns' tokens (their end-of-turn token
            included), 0 elsewhere.
    """

    prompt_ids: np.ndarray
    response_ids: np.ndarray
    loss_mask: np.ndarray

    @property
    def length(self) -> int:
        """``P + R`` tokens."""
        return len(self.prompt_ids) + len(self.response_ids)


def turn_closing(tokenizer: PromptTokenizer, **kwargs: Any) -> tuple[str, str]:
    """``(closing, stop)``: the text the chat template writes after an assistant message's
    content (e.g. ``"<|im_end|>\\n"``), and its start that is one of the tokenizer's stop tokens
    (:attr:`PromptTokenizer.eos_token_ids`, e.g. ``"<|im_end|>"``): the end of what a policy
    generates in a turn. ``kwargs`` go to ``apply_chat_template``.

    Raises:
        ConversationError: reason ``template``: the template does not render an assistant
            message's content verbatim, or its closing does not start with a stop token.
    """
    tok = tokenizer.tokenizer
    rendered = tok.apply_chat_template([{"role": "user", "content": "x"},
                                        {"role": "assistant", "content": _MARKER}],
                                       tokenize=False, **kwargs)
    at = rendered.rfind(_MARKER)
    if at < 0:
        raise ConversationError("template", f"the chat template of {tokenizer.directory} does not "
                                            "render an assistant message's content verbatim")
    closing = rendered[at + len(_MARKER):]
    for eos in tokenizer.eos_token_ids:
        stop = tok.decode([eos], skip_special_tokens=False)
        if stop and closing.startswith(stop):
            return closing, stop
    raise ConversationError("template", f"the chat template of {tokenizer.directory} closes an "
                                        f"assistant turn with {closing!r}, which does not start "
                                        f"with a stop token {list(tokenizer.eos_token_ids)}: the "
                                        "end of a turn is unknown")


def _checked(messages: Any, where: str) -> list[dict]:
    """The messages as plain dicts; ConversationError for a malformed list or role."""
    if not isinstance(messages, list) or not messages:
        raise ConversationError("malformed", f"{where}: 'messages' must be a non-empty list of "
                                             f"message objects, got {messages!r:.80}")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ConversationError("malformed", f"{where}: message {i} must be an object with a "
                                                 f"'role' string, got {m!r:.80}")
        if m["role"] not in ROLES:
            raise ConversationError("unknown_role", f"{where}: message {i} has role "
                                                    f"{m['role']!r}; known roles: {list(ROLES)}")
        content = m.get("content")
        if not (isinstance(content, str) or (content is None and m["role"] == "assistant"
                                              and m.get("tool_calls"))):
            raise ConversationError("malformed", f"{where}: message {i} ({m['role']}) needs a "
                                                 f"'content' string, got {content!r:.80}")
        out.append({k: v for k, v in m.items() if v is not None})
    return out


def render_conversation(tokenizer: PromptTokenizer, messages: Any, *, max_length: int,
                        tools: Sequence[Mapping[str, Any]] | None = None,
                        where: str = "conversation") -> Conversation:
    """One conversation as prompt ids, response ids and the assistant-only loss mask (see the
    module docstring for how the template's text is cut).

    Args:
        tokenizer: the checkpoint's tokenizer with its chat template (its
            ``chat_template_kwargs`` and, without ``tools``, its ``tools`` are used).
        messages: the conversation (TRL's conversational format).
        max_length: the most tokens ``P + R`` may have.
        tools: the row's tool schema (``apply_chat_template(tools=...)``), or None.
        where: names the row in errors (``"FILE:LINE"``).

    Returns:
        :class:`Conversation` with read-only arrays.

    Raises:
        ConversationError: naming ``where`` and the reason (:attr:`ConversationError.reason`):
            a malformed message list, an unknown role, no assistant message, more than
            ``max_length`` tokens, or a template whose pieces do not join into the whole
            conversation.
    """
    msgs = _checked(messages, where)
    assistants = [k for k, m in enumerate(msgs) if m["role"] == "assistant"]
    if not assistants:
        raise ConversationError("no_assistant", f"{where}: no assistant message: nothing to learn")
    msgs = msgs[:assistants[-1] + 1]
    kwargs = dict(tokenizer.chat_template_kwargs)
    schema = tools if tools is not None else tokenizer.tools
    if schema:
        kwargs["tools"] = [dict(t) for t in schema]
    tok = tokenizer.tokenizer
    try:
        closing, stop = turn_closing(tokenizer, **kwargs)

        def render(part: list[dict], generation: bool) -> str:
            return tok.apply_chat_template(part, tokenize=False, add_generation_prompt=generation,
                                           **kwargs)

        pieces: list[tuple[str, int]] = []  # (text, loss mask) in order
        done = ""  # the conversation's text covered by the pieces so far
        for k in assistants:
            head, full = render(msgs[:k], True), render(msgs[:k + 1], False)
            if not (head.startswith(done) and full.startswith(head)):
                raise ConversationError("template", f"{where}: the chat template of "
                                        f"{tokenizer.directory} rewrites earlier text when "
                                        f"message {k} is added; the conversation cannot be cut "
                                        "into turns")
            turn = full[len(head):]
            if not turn.endswith(closing):
                raise ConversationError("template", f"{where}: the chat template does not close "
                                        f"assistant message {k} with {closing!r}")
            own = turn[:len(turn) - len(closing) + len(stop)]
            pieces += [(head[len(done):], 0), (own, 1)]
            done = head + own
    except ConversationError:
        raise
    except Exception as exc:  # jinja's / the tokenizer's own errors, kept in the message
        raise ConversationError("template", f"{where}: the chat template failed: "
                                            f"{type(exc).__name__}: {exc}") from None
    ids: list[np.ndarray] = []
    for text, _ in pieces:
        ids.append(np.asarray(tok(text, add_special_tokens=False)["input_ids"] if text else [],
                              dtype=np.int32))
    prompt = ids[0]
    if len(prompt) == 0:
        raise ConversationError("template", f"{where}: the prompt before the first assistant "
                                            "message renders to no tokens")
    response = np.concatenate(ids[1:])
    mask = np.concatenate([np.full(len(a), m, np.uint8) for a, (_, m) in zip(ids[1:], pieces[1:])])
    total = len(prompt) + len(response)
    if total > max_length:
        raise ConversationError("too_long", f"{where}: {total} tokens, longer than the limit of "
                                            f"{max_length} (--max-length, at most the model's "
                                            "positions)")
    for a in (prompt, response, mask):
        a.flags.writeable = False
    return Conversation(prompt, response, mask)
