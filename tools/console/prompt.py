"""The interactive console of ``replayrl repl``: prompt_toolkit for the line editor, the
standard library's :class:`code.InteractiveConsole` for Python's own semantics
(docs/design/multi-host.md#attach-and-multi-host).

prompt_toolkit (a well-kept library, also under IPython and ptpython) gives history, multi-line
editing and Tab completion that asks the actors themselves for their methods (``dir`` of a
console proxy). ``code`` compiles and runs each statement exactly as ``python -i`` would
(incomplete input, tracebacks, ``exit()``). Without a terminal (input from a pipe or a file)
the console reads plain lines, as ``python`` does.
"""
from __future__ import annotations

import code
import re
import rlcompleter
import sys
from typing import Any, Iterable

from prompt_toolkit import PromptSession
from prompt_toolkit.completion import Completer, Completion
from prompt_toolkit.history import InMemoryHistory

from replayrl.actors import ActorCallError, UnknownActor
from replayrl.tools.errors import MetricKeyError

__all__ = ["Console", "NamespaceCompleter"]

_WORD = re.compile(r"[\w.]+")

_TYPOS = (ActorCallError, UnknownActor, MetricKeyError)
"""Errors :meth:`Console.showtraceback` prints as one line (the user's typo)."""


class NamespaceCompleter(Completer):
    """prompt_toolkit completer over the console's namespace (``rlcompleter``'s rules:
    names, then attributes after a dot, which for an actor proxy are its remote methods)."""

    def __init__(self, namespace: dict[str, Any]) -> None:
        self._rl = rlcompleter.Completer(namespace)

    def get_completions(self, document, complete_event) -> Iterable[Completion]:
        """The candidates for the dotted word before the cursor."""
        word = document.get_word_before_cursor(pattern=_WORD)
        if not word:
            return
        seen = set()
        for i in range(1000):  # rlcompleter returns None after the last candidate
            candidate = self._rl.complete(word, i)
            if candidate is None:
                break
            if candidate not in seen:
                seen.add(candidate)
                yield Completion(candidate, start_position=-len(word))


class Console(code.InteractiveConsole):
    """``code.InteractiveConsole`` reading its lines through a prompt_toolkit session when
    stdin and stdout are terminals.

    Args:
        namespace: the console's globals.
        filename: shown in tracebacks of typed code.
    """

    def __init__(self, namespace: dict[str, Any], filename: str = "<replayrl>") -> None:
        super().__init__(namespace, filename=filename)
        self._session = None
        if sys.stdin.isatty() and sys.stdout.isatty():
            # completion asks the actors (a call each): on Tab only, not at every key
            self._session = PromptSession(history=InMemoryHistory(),
                                          completer=NamespaceCompleter(namespace),
                                          complete_while_typing=False)

    PS1 = "replayrl> "
    PS2 = "......... "

    def interact(self, banner: str | None = None, exitmsg: str | None = None) -> None:
        """``code.InteractiveConsole.interact`` with the prompts :attr:`PS1` / :attr:`PS2`."""
        sys.ps1, sys.ps2 = self.PS1, self.PS2
        super().interact(banner=banner, exitmsg=exitmsg)

    def showtraceback(self) -> None:
        """A call the user mistyped is a typo, not a failure: one line naming what was refused
        and the close matches, without the console's own frames -- a misspelt method or
        arguments that do not fit (:class:`replayrl.actors.ActorCallError`), an actor name the run does
        not have (:class:`replayrl.actors.UnknownActor`), a metrics key no row has
        (:class:`replayrl.tools.console.views.MetricKeyError`). Every other error shows its traceback, as
        ``python -i`` does."""
        error = sys.exc_info()[1]
        if isinstance(error, _TYPOS):
            # UnknownActor is a KeyError, whose str() is the repr of its message: print the
            # message itself
            message = error.args[0] if len(error.args) == 1 else str(error)
            self.write(f"{type(error).__name__}: {message}\n")
            return
        super().showtraceback()

    def raw_input(self, prompt: str = "") -> str:
        """One line from the user; ``EOFError`` on Ctrl-D, ``KeyboardInterrupt`` on Ctrl-C."""
        if self._session is None:
            return super().raw_input(prompt)
        return self._session.prompt(prompt)
