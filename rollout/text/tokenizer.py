"""The run's tokenizer and chat template, read from a Hugging Face checkpoint directory.

Everything goes through transformers' own tokenizer classes (``AutoTokenizer``, or the class it
resolves to: :mod:`replayrl.rollout.text.tokenizer_class`; a tokenizer transformers only wraps through
the ``tokenizers`` library it wraps, :mod:`replayrl.rollout.text.backend_tokenizer`): the directory's
``tokenizer.json`` / ``tokenizer_config.json`` (and ``chat_template.jinja`` when present) give
the vocabulary and the chat template, ``generation_config.json`` the ids that end a response.
replayrl never re-implements a tokenizer or a template.

Token ids, not text, are the unit of a trajectory: a multi-turn context is the previous
context's exact ids plus the ids of the rendered observation *delta* (docs/design/prompt-data.md#prompt-data),
so the ids the trainer trains on are the ids the engine
saw, with no re-tokenisation of the conversation text in between.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, Mapping, Sequence

import numpy as np

from replayrl.rollout.errors import ChatTemplateError, TokenizerError
from replayrl.rollout.text.tokenizer_class import load_tokenizer_object

__all__ = [ "PromptTokenizer", "load_tokenizer"]

# A fixed two-message conversation the observation delta is rendered after: the delta of a tool
# turn is the text the template adds for that message (and the next generation prompt), which a
# template computes from the roles alone, not from earlier contents. The assistant content is a
# marker no template writes itself, so the text after it is the template's closing of a turn.
_BASE_CONVERSATION = ({"role": "user", "content": "x"},
                      {"role": "assistant", "content": "replayrl-assistant-turn"})


@dataclass(frozen=True)
class PromptTokenizer:
    """A transformers tokenizer with the run's chat-template settings and stop ids.

    Attributes:
        tokenizer: the ``transformers`` tokenizer (``PreTrainedTokenizerBase``), or for a
            tokenizer transformers only wraps, the ``tokenizers``-backed
            :class:`replayrl.rollout.text.backend_tokenizer.BackendTokenizer` with the same calls
            (``tokenizer(text)``, ``decode``, ``get_vocab``, ``len``; the rest through transformers).
        directory: where it was read from (named in errors).
        eos_token_ids: ids that end a response, from ``generation_config.json``'s
            ``eos_token_id`` (an int or a list), else the tokenizer's ``eos_token_id``; the
            engine stops on the first one.
        apply_chat_template: prompts (and observations) are rendered with the chat template.
        chat_template_kwargs: extra keyword arguments of ``apply_chat_template`` (e.g.
            ``{"enable_thinking": false}``), read-only.
        tools: the tool schema prompts are rendered with (``apply_chat_template(tools=...)``,
            an ``--env`` environment's ``tools``); ``()`` renders none.
    """

    tokenizer: Any
    directory: str
    eos_token_ids: tuple[int, ...]
    apply_chat_template: bool = False
    chat_template_kwargs: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    tools: tuple[Mapping[str, Any], ...] = ()

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer can produce (``len(tokenizer)``, added tokens included)."""
        return len(self.tokenizer)

    @property
    def eos_token_id(self) -> int:
        """The id the engine stops on (the first of :attr:`eos_token_ids`)."""
        return self.eos_token_ids[0]

    def _messages(self, prompt: str | Sequence[Mapping[str, Any]]) -> list[dict]:
        if isinstance(prompt, str):
            return [{"role": "user", "content": prompt}]
        return [dict(m) for m in prompt]

    def encode_prompt(self, prompt: str | Sequence[Mapping[str, Any]]) -> np.ndarray:
        """The token ids of one prompt, read-only int32 ``[P]``.

        With :attr:`apply_chat_template`, a text prompt becomes one user message and a list of
        ``{"role", "content"}`` messages is taken as is; the template adds the generation
        prompt. Without it, a text prompt is encoded as the tokenizer encodes text (its own
        special-token rule), and a message list is an error.

        Raises:
            TokenizerError: a message list without ``--apply-chat-template``, an empty result,
                or the tokenizer / template failed (its message included).
        """
        try:
            if self.apply_chat_template:
                extra = {"tools": [dict(t) for t in self.tools]} if self.tools else {}
                rendered = self.tokenizer.apply_chat_template(
                    self._messages(prompt), tokenize=False, add_generation_prompt=True,
                    **extra, **dict(self.chat_template_kwargs))
                ids = self.tokenizer(rendered, add_special_tokens=False)["input_ids"]
            elif isinstance(prompt, str):
                ids = self.tokenizer(prompt)["input_ids"]
            else:
                raise TokenizerError("a list of messages needs --apply-chat-template")
        except TokenizerError:
            raise
        except Exception as exc:  # the tokenizer's / jinja's own errors, kept in the message
            raise TokenizerError(f"tokenizer {self.directory}: {type(exc).__name__}: {exc}") from exc
        out = np.asarray(ids, dtype=np.int32)
        if out.ndim != 1 or len(out) == 0:
            raise TokenizerError("the prompt encodes to no tokens")
        out.flags.writeable = False
        return out

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        """The text of ``ids`` with special tokens (EOS, template markers) left out."""
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=True)

    def render_observation(self, observation_ids: Sequence[int] | np.ndarray,
                           turn_ids: Sequence[int] | np.ndarray, *,
                           sample_id: Any = None) -> np.ndarray:
        """The ids to append to a context after a tool call: the observation as a tool turn.

        Without the chat template the environment's ids are appended unchanged. With it, the
        result is the text the template renders between the turn's last generated token and
        the next turn's content, tokenised alone, so that prompt + turn 0 + observation 0 +
        turn 1 + ... is, token for token, ``apply_chat_template`` of the whole conversation:

        * the *closing* the template writes after an assistant message's content
          (``render(base)`` after the content of its assistant message, e.g. Qwen's
          ``"<|im_end|>\\n"``). A turn ending with a stop id (:attr:`eos_token_ids`) whose text
          starts the closing keeps that generated token, and only the rest of the closing
          (the separator, e.g. ``"\\n"``) is appended; a turn cut before its end-of-turn
          token (``"length"``) gets the whole closing;
        * the *tool turn*: the observation's text (:meth:`decode`) as a ``{"role": "tool"}``
          message plus the next generation prompt, ``render(base + [tool], generation
          prompt)`` minus ``render(base)``.

        Only this text is tokenised; the context before it keeps its exact ids. The caller
        gives these rows loss mask 0 and no trace rows (``merge_turns``' observation rows).

        Args:
            observation_ids: the environment's observation ids ``[O_env]``.
            turn_ids: the ids the policy generated in the turn the observation answers.
            sample_id: names the trajectory in errors (the turn loop: its row in the batch).

        Returns:
            read-only int32 ``[O]``, ``O >= 1``.

        Raises:
            ChatTemplateError: field ``observations``: the template does not extend the base
                conversation by a suffix (it rewrites earlier turns when a tool message is
                added) or does not render an assistant message's content verbatim; field
                ``response_ids``: the turn ends with a stop id the template renders inside its
                closing but not right after the content.
            TokenizerError: the rendering is empty.
        """
        if not self.apply_chat_template:
            out = np.array(observation_ids, dtype=np.int32)
        else:
            out = np.asarray(self.tokenizer(self._tool_turn_text(self.decode(observation_ids),
                                                                 turn_ids, sample_id),
                                            add_special_tokens=False)["input_ids"], dtype=np.int32)
        if len(out) == 0:
            raise TokenizerError("the observation renders to no tokens")
        out.flags.writeable = False
        return out

    def render_tool_text(self, text: str, turn_ids: Sequence[int] | np.ndarray, *,
                         sample_id: Any = None) -> np.ndarray:
        """The ids to append after a tool call whose answer is ``text`` (an ``--env``
        environment's observation): as :meth:`render_observation`, with ``text`` as the tool
        message's content. Without the chat template, ``text`` tokenised alone (no special
        tokens added).

        Returns:
            read-only int32 ``[O]``, ``O >= 1``.
        Raises:
            ChatTemplateError, TokenizerError: as :meth:`render_observation`.
        """
        rendered = (self._tool_turn_text(str(text), turn_ids, sample_id)
                    if self.apply_chat_template else str(text))
        out = np.asarray(self.tokenizer(rendered, add_special_tokens=False)["input_ids"],
                         dtype=np.int32)
        if len(out) == 0:
            raise TokenizerError("the observation renders to no tokens")
        out.flags.writeable = False
        return out

    def render_opening(self, opening: str | Sequence[Mapping[str, Any]],
                       prompt_ids: Sequence[int] | np.ndarray, *, sample_id: Any = None) -> np.ndarray:
        """The prompt ids of an episode whose environment opens it with messages (an ``--env``
        environment's ``Reset.observation``): the exact ``prompt_ids``, the opening inserted
        before the generation prompt they end with.

        With the chat template, ``opening`` (text = one ``{"role": "tool"}`` message, or a list
        of ``{"role", "content"}`` messages, e.g. a system message) is rendered after a user
        message: ``render(base + opening, generation prompt)`` minus ``render(base)``, with
        ``base`` a fixed one-message conversation (the text a template adds for a message
        depends on the roles, not on earlier contents). The result is ``prompt_ids`` without the
        ids of the generation prompt at their end (``render(base, generation prompt)`` minus
        ``render(base)``, tokenised alone), then that text tokenised alone: only the opening
        is tokenised; the prompt keeps its exact ids. Without the chat template, text is
        tokenised alone (no special tokens added) and appended to ``prompt_ids``.

        Args:
            opening: the opening messages (see above), non-empty.
            prompt_ids: the episode's ``[P]`` prompt ids (:meth:`encode_prompt`'s).
            sample_id: names the trajectory in errors.

        Returns:
            read-only int32 ``[P']``, ``P' > P - G`` (``G`` the generation prompt's ids).

        Raises:
            ChatTemplateError: field ``prompt_ids``: the prompt does not end with the template's
                generation prompt, or the template rewrites earlier turns when the opening is
                added.
            TokenizerError: a message list without the chat template, a malformed message, or
                an empty opening.
        """
        messages = ([{"role": "tool", "content": opening}] if isinstance(opening, str)
                    else [dict(m) for m in opening])
        if not messages or not all(isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                                   for m in messages):
            raise TokenizerError("an opening must be text or a non-empty list of "
                                 "{'role': str, 'content': str} messages")
        prompt = [int(t) for t in prompt_ids]
        if not self.apply_chat_template:
            if not isinstance(opening, str):
                raise TokenizerError("an opening list of messages needs --apply-chat-template")
            added = self.tokenizer(opening, add_special_tokens=False)["input_ids"]
        else:
            kwargs = dict(self.chat_template_kwargs)
            if self.tools:
                kwargs["tools"] = [dict(t) for t in self.tools]
            base = [dict(_BASE_CONVERSATION[0])]
            before = self.tokenizer.apply_chat_template(base, tokenize=False, **kwargs)
            generation = self.tokenizer.apply_chat_template(base, tokenize=False,
                                                            add_generation_prompt=True, **kwargs)
            after = self.tokenizer.apply_chat_template(base + messages, tokenize=False,
                                                       add_generation_prompt=True, **kwargs)
            if not (generation.startswith(before) and after.startswith(before)):
                raise ChatTemplateError(sample_id, "prompt_ids",
                                        f"the chat template of {self.directory} rewrites earlier "
                                        "turns when an opening message is added; it cannot be "
                                        "inserted into the exact prompt")
            cut = self.tokenizer(generation[len(before):], add_special_tokens=False)["input_ids"]
            if cut and prompt[len(prompt) - len(cut):] != list(cut):
                raise ChatTemplateError(sample_id, "prompt_ids",
                                        f"the prompt does not end with the generation prompt "
                                        f"{generation[len(before):]!r} of the chat template of "
                                        f"{self.directory}; the opening has no place to go")
            prompt = prompt[:len(prompt) - len(cut)]
            added = self.tokenizer(after[len(before):], add_special_tokens=False)["input_ids"]
        if len(added) == 0:
            raise TokenizerError("the opening renders to no tokens")
        out = np.asarray(prompt + list(added), dtype=np.int32)
        out.flags.writeable = False
        return out

    def _tool_turn_text(self, content: str, turn_ids: Sequence[int] | np.ndarray,
                        sample_id: Any) -> str:
        """The text :meth:`render_observation` tokenises: the rest of the turn's closing, then
        the tool turn and the next generation prompt."""
        kwargs = dict(self.chat_template_kwargs)
        base = [dict(m) for m in _BASE_CONVERSATION]
        before = self.tokenizer.apply_chat_template(base, tokenize=False, **kwargs)
        after = self.tokenizer.apply_chat_template(
            base + [{"role": "tool", "content": content}],
            tokenize=False, add_generation_prompt=True, **kwargs)
        if not after.startswith(before):
            raise ChatTemplateError(sample_id, "observations",
                                    f"the chat template of {self.directory} rewrites earlier "
                                    "turns when a tool message is added; observation tokens "
                                    "cannot be appended to the exact context")
        content = _BASE_CONVERSATION[-1]["content"]
        at = before.rfind(content)
        if at < 0:
            raise ChatTemplateError(sample_id, "observations",
                                    f"the chat template of {self.directory} does not render an "
                                    "assistant message's content verbatim; the text it closes "
                                    "a turn with is unknown")
        closing = before[at + len(content):]
        last = int(turn_ids[-1]) if len(turn_ids) else None
        if last in self.eos_token_ids:
            stop = self.tokenizer.decode([last], skip_special_tokens=False)
            if stop and closing.startswith(stop):
                closing = closing[len(stop):]  # the generated end-of-turn token is kept
            elif stop and stop in closing:
                raise ChatTemplateError(sample_id, "response_ids",
                                        f"the turn ends with stop id {last} ({stop!r}), which "
                                        f"the chat template of {self.directory} renders inside "
                                        f"the closing {closing!r}, not right after the content")
        return closing + after[len(before):]


def _stop_ids(directory: Path, tokenizer: Any) -> tuple[int, ...]:
    path = directory / "generation_config.json"
    if path.exists():
        try:
            eos = json.loads(path.read_text()).get("eos_token_id")
        except (OSError, ValueError) as exc:
            raise TokenizerError(f"{path}: {exc}") from None
        if isinstance(eos, int):
            return (eos,)
        if isinstance(eos, list) and eos and all(isinstance(e, int) for e in eos):
            return tuple(eos)
        if eos is not None:
            raise TokenizerError(f"{path}: eos_token_id must be an int or a list of ints, got {eos!r}")
    if tokenizer.eos_token_id is None:
        raise TokenizerError(f"--tokenizer {directory}: no eos_token_id in generation_config.json "
                             "and the tokenizer has no eos_token")
    return (int(tokenizer.eos_token_id),)


def load_tokenizer(directory: str | Path, *, apply_chat_template: bool = False,
                   chat_template_kwargs: Mapping[str, Any] | None = None,
                   tools: Sequence[Mapping[str, Any]] = (),
                   tokenizer_class: str | None = None, tokenizer_object: Any = None) -> PromptTokenizer:
    """Read the tokenizer of a Hugging Face checkpoint directory with ``AutoTokenizer``, or with
    the class it resolves to (``tokenizer_class``), which loads without torch.

    Args:
        directory: holds ``tokenizer.json`` / ``tokenizer_config.json`` (and optionally
            ``generation_config.json``, ``chat_template.jinja``); nothing is downloaded.
        apply_chat_template: render prompts with the chat template (``--apply-chat-template``).
        chat_template_kwargs: extra ``apply_chat_template`` arguments
            (``--apply-chat-template-kwargs``).
        tools: the tool schema prompts are rendered with (the ``--env`` environment's).
        tokenizer_class: ``"module:QualName"`` from
            :func:`replayrl.rollout.text.tokenizer_class.resolve_tokenizer_class` (the same
            tokenizer as ``AutoTokenizer``'s, without importing torch); None or ``"auto"``:
            ``AutoTokenizer``.
        tokenizer_object: the transformers tokenizer of ``directory`` as ``tokenizer_class``
            loads it, loaded already (:func:`replayrl.rollout.text.tokenizer_class.resolve_tokenizer`);
            None: load it here.

    Raises:
        TokenizerError: the directory has no loadable tokenizer, no stop id, or no chat template
            while one is asked for (each names the directory and the flag).
    """
    path = Path(directory)
    if not path.is_dir():
        raise TokenizerError(f"--tokenizer {path}: not a directory")
    try:
        tokenizer = (load_tokenizer_object(path, tokenizer_class) if tokenizer_object is None
                     else tokenizer_object)
    except Exception as exc:  # transformers raises OSError / ValueError / others
        raise TokenizerError(f"--tokenizer {path}: cannot load a tokenizer: "
                             f"{type(exc).__name__}: {exc}") from None
    if apply_chat_template and not getattr(tokenizer, "chat_template", None):
        raise TokenizerError(f"--apply-chat-template: the tokenizer in {path} has no chat "
                             "template (tokenizer_config.json 'chat_template' or "
                             "chat_template.jinja)")
    return PromptTokenizer(tokenizer, str(path), _stop_ids(path, tokenizer), apply_chat_template,
                           MappingProxyType(dict(chat_template_kwargs or {})),
                           tuple(MappingProxyType(dict(t)) for t in tools))
