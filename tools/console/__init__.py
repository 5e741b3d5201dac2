"""The actor console: ``replayrl repl`` (start a run and drive it) and ``--attach`` (join a
running one), its line editor and what it prints."""
