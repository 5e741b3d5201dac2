"""Typed actor calls: the proxy checks method names and arguments in the caller, across processes."""
from __future__ import annotations

import tempfile

import pytest

from replayrl.actors import ActorCallError, ActorSpec, Directory, RemoteError, Supervisor
from replayrl.actors.interface import describe
from tests.actor_fixtures import EchoActor

ECHO = "tests.actor_fixtures:EchoActor"


@pytest.fixture
def run_dir():
    with tempfile.TemporaryDirectory(prefix="rrl-") as d:  # short path: AF_UNIX limit
        yield d


def test_describe_lists_public_async_methods_without_self_or_hooks():
    info = describe(EchoActor)
    assert info["actor_class"] == "EchoActor"
    assert set(info["methods"]) == {"echo", "total", "fail", "sleep", "sleep_concurrently",
                                    "record", "recorded", "pid", "crash", "torch_imported", "type_name"}
    assert info["methods"]["record"] == {"params": [["i", "POSITIONAL_OR_KEYWORD", False]],
                                         "text": "record(i: int) -> None",
                                         "doc": ""}


async def test_proxy_checks_calls_at_the_call_site(run_dir):
    directory = Directory.for_run(run_dir, ["a"])
    async with Supervisor([ActorSpec("a", ECHO, {})], directory, run_dir):
        a = directory.proxy("a", timeout=30)
        assert await a.echo({"x": [1, 2]}) == {"x": [1, 2]}
        await a.record(5)

        with pytest.raises(ActorCallError) as info:
            await a.recrod(6)  # misspelt
        # the closest names, best first; an unlike name lists every method instead
        assert str(info.value) == ("actor 'a' (EchoActor) has no method 'recrod'; did you mean "
                                   "'record' or 'recorded'?")
        with pytest.raises(ActorCallError, match=r"has no method 'zzz'; its methods: crash, echo, "
                                                 r"fail, pid, record, recorded, sleep, "):
            await a.zzz()

        with pytest.raises(ActorCallError, match=r"a\.record\(i: int\) -> None: too many"):
            await a.record(7, 8)
        with pytest.raises(ActorCallError, match="missing a required argument: 'i'"):
            await a.record()
        with pytest.raises(ActorCallError, match="unexpected keyword argument 'j'"):
            await a.record(1, j=1)
        # none of the refused calls reached the actor
        assert await a.recorded() == [5]

        # the interface carries docstrings (for consoles), and any actor tells the run's endpoints
        docs = (await a.interface()).docs
        assert docs["fail"] == "Raise ``ValueError(message)``.\n\n(A docstring for the interface tests.)"
        assert docs["record"] == ""
        assert await directory.ref("a").call("__directory__", timeout=30) == directory.to_dict()

        # a remote failure is still a RemoteError, and the proxy's timeout applies
        with pytest.raises(RemoteError, match="bad"):
            await a.fail("bad")
        # lifecycle hooks are not callable by peers
        with pytest.raises(RemoteError, match="no public async method 'on_start'"):
            await directory.ref("a").call("on_start")
