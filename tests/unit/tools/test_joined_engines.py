"""The pieces that let a torchrun run lose an engine host (docs/design/multi-host.md#attach-and-multi-host):
the plan with joined engines, joining through the run's store, the refusal
of ``--engine-failure restart`` and a rank leaving when its driver is lost. The run itself is
tests/system/test_multi_host.py (network namespaces, root)."""
from __future__ import annotations

import asyncio
import threading
import time

import pytest

from replayrl.tools.errors import ConfigError
from replayrl.tools.run.from_flags import build_config


def _config(tmp_path, **extra):
    return build_config({"rollout-batch-size": 2, "n-samples-per-prompt": 2,
                         "output-dir": str(tmp_path), **extra})


def test_joined_engines_come_after_the_runs_own(tmp_path):
    from replayrl.tools.run.torchrun_entry import joined_engine, plan

    config = _config(tmp_path)
    # 3 ranks (driver, engine_0, trainer) + 2 joined: engine_1 and engine_2 come from outside
    specs, roles = plan(3, config, base_port=40000, joined=2)
    assert roles == {0: ["version_clock", "rollout_manager"], 1: ["engine_0"], 2: ["trainer"]}
    assert [s.name for s in specs] == ["version_clock", "engine_0", "engine_1", "engine_2",
                                       "rollout_manager", "trainer"]
    assert [joined_engine(3, config, j) for j in (0, 1)] == ["engine_1", "engine_2"]
    # every engine on a joined host: the run's world is the driver and the trainer
    specs, roles = plan(2, config, joined=1)
    assert roles == {0: ["version_clock", "rollout_manager"], 1: ["trainer"]}
    assert joined_engine(2, config, 0) == "engine_0"
    with pytest.raises(ConfigError, match="--joined-engines"):
        plan(2, config)  # no engine anywhere


def test_a_joined_rank_takes_a_slot_and_sees_every_address():
    import torch.distributed as dist

    from replayrl.tools.errors import RendezvousError
    from replayrl.tools.run.launcher import free_port
    from replayrl.tools.run.rank_hosts import join_run

    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    # the run's rank 0 and 1, as exchange_addresses publishes them, expecting one joined engine
    store.set("replayrl/plan", "2 1")
    hosts = dist.PrefixStore("replayrl/host/", store)
    hosts.set("0", "10.0.0.1")
    hosts.set("1", "10.0.0.2")
    joined = join_run("127.0.0.1", port, "10.0.0.9", timeout_s=30)
    assert (joined.slot, joined.world_size, joined.joined) == (0, 2, 1)
    assert joined.addresses == ["10.0.0.1", "10.0.0.2", "10.0.0.9"]
    with pytest.raises(RendezvousError, match="slot 1 .* --joined-engines 1"):
        join_run("127.0.0.1", port, "10.0.0.10", timeout_s=30)


def test_restart_is_refused_under_torchrun_with_the_reason(tmp_path):
    from replayrl.tools.run.torchrun_entry import refuse_restart

    refuse_restart(_config(tmp_path, **{"engine-failure": "regenerate"}))
    with pytest.raises(ConfigError, match="restart is not available under torchrun.*lost "
                                          "engine's host"):
        refuse_restart(_config(tmp_path, **{"engine-failure": "restart"}))


class _Exits:
    """Records the code a DriverWatch exits with, instead of exiting."""

    def __init__(self) -> None:
        self.codes: list[int] = []
        self.done = threading.Event()

    def __call__(self, code: int) -> None:
        self.codes.append(code)
        self.done.set()


async def _wait(event: threading.Event, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while not event.is_set() and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    return event.is_set()


async def test_a_rank_leaves_when_its_driver_closes_and_stays_when_stopped(curve_keys,
                                                                          curve_keys_dir):
    from replayrl.actors import Directory
    from replayrl.tools.run.driver_watch import DriverWatch
    from replayrl.tools.run.exit_codes import EXIT_DRIVER_LOST
    from replayrl.tools.run.launcher import free_port
    from replayrl.transport import RouterSocket

    endpoint = f"tcp://127.0.0.1:{free_port()}"
    directory = Directory({"version_clock": endpoint}, curve_keys_dir, heartbeat_deadline_s=1.0)
    driver = RouterSocket(endpoint, lambda peer, frames: None, curve=curve_keys)
    driver.bind()
    exits, kept = _Exits(), _Exits()
    watch = DriverWatch(directory, ready_timeout_s=60, grace_s=0.5, rank=1, exit=exits).start()
    stopped = DriverWatch(directory, ready_timeout_s=60, grace_s=0.5, rank=2, exit=kept).start()
    await asyncio.sleep(1.0)  # both connect (a ready timeout of 60 s is not what ends them)
    stopped.close()  # this rank ended normally: losing the driver later means nothing to it
    assert not exits.done.is_set()
    driver.close()  # the driver's process is gone
    assert await _wait(exits.done, 30), "the watch never noticed the driver was gone"
    assert exits.codes == [EXIT_DRIVER_LOST]
    await asyncio.sleep(1.0)
    assert kept.codes == []
    watch.close()


async def test_a_rank_leaves_when_its_driver_never_answers(curve_keys_dir):
    from replayrl.actors import Directory
    from replayrl.tools.run.driver_watch import DriverWatch
    from replayrl.tools.run.exit_codes import EXIT_DRIVER_LOST
    from replayrl.tools.run.launcher import free_port

    directory = Directory({"version_clock": f"tcp://127.0.0.1:{free_port()}"}, curve_keys_dir,
                          heartbeat_deadline_s=1.0)
    exits = _Exits()
    watch = DriverWatch(directory, ready_timeout_s=0.5, rank=1, exit=exits).start()
    assert await _wait(exits.done, 30)
    assert exits.codes == [EXIT_DRIVER_LOST]
    watch.close()


def test_a_joined_host_with_other_model_flags_is_refused_before_it_joins(tmp_path):
    import torch.distributed as dist

    from replayrl.tools.run.launcher import free_port
    from replayrl.tools.run.rank_hosts import join_run
    from replayrl.tools.run.torchrun_entry import check_joined_settings

    run = _config(tmp_path / "run")
    # per-host flags may differ: its own output directory, console, and --num-engines
    check_joined_settings(run.to_json(), _config(tmp_path / "host", progress=False,
                                                 **{"num-engines": 3}))
    joiner = _config(tmp_path / "host", **{"model-indexer": False, "rollout-max-response-len": 7})
    with pytest.raises(ConfigError, match=r"--model-indexer \(run: True, here: False\).*"
                                          r"--rollout-max-response-len \(run: 2, here: 7\)"):
        check_joined_settings(run.to_json(), joiner)
    assert "--output-dir" not in _refusal(run, joiner)
    # through the store: the run's rank 0 publishes its settings, the joiner never publishes
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    store.set("replayrl/settings", run.to_json())
    store.set("replayrl/plan", "2 1")
    with pytest.raises(ConfigError, match="--model-indexer"):
        join_run("127.0.0.1", port, "10.0.0.9", timeout_s=30,
                 check=lambda settings: check_joined_settings(settings, joiner))
    assert not dist.PrefixStore("replayrl/host/", store).check(["joined-0"])


def _refusal(run, joiner) -> str:
    from replayrl.tools.run.torchrun_entry import check_joined_settings

    try:
        check_joined_settings(run.to_json(), joiner)
    except ConfigError as exc:
        return str(exc)
    raise AssertionError("not refused")


def test_a_missing_rank_or_joined_engine_is_named():
    import torch.distributed as dist

    from replayrl.tools.errors import RendezvousError
    from replayrl.tools.run.launcher import free_port
    from replayrl.tools.run.rank_hosts import join_run

    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    store.set("replayrl/plan", "3 2")  # ranks 0..2 and joined engines 0, 1
    hosts = dist.PrefixStore("replayrl/host/", store)  # as exchange_addresses publishes them
    hosts.set("0", "10.0.0.1")
    hosts.set("2", "10.0.0.3")
    with pytest.raises(RendezvousError, match=r"no address from rank 1, joined engine 1 within 1 s"):
        join_run("127.0.0.1", port, "10.0.0.9", timeout_s=1)


@pytest.mark.parametrize("failure", ["RemoteError: trainer.train_step raised: boom", ""])
def test_a_joined_rank_fails_when_the_driver_stops_it_after_a_failed_run(curve_keys_dir, failure):
    from replayrl.actors import ActorError, ActorSpec, Directory
    from replayrl.actors.ref import use_curve_keys
    from replayrl.tools.errors import RunFailed
    from replayrl.tools.run.launcher import free_port
    from replayrl.tools.run.torchrun_entry import _serve_watched

    directory = Directory({"version_clock": f"tcp://127.0.0.1:{free_port()}",  # no driver here
                           "engine_1": f"tcp://127.0.0.1:{free_port()}"}, curve_keys_dir,
                          heartbeat_deadline_s=1.0)
    raised: list[BaseException] = []

    def rank() -> None:
        try:
            _serve_watched(["engine_1"], [ActorSpec("engine_1", "tests.actor_fixtures:EchoActor")],
                           directory, ready_timeout=60, rank="joined 0")
        except BaseException as exc:  # noqa: BLE001 (handed to the test's thread)
            raised.append(exc)

    thread = threading.Thread(target=rank, daemon=True)
    thread.start()

    async def stop() -> None:  # as the driver's _drive stops a joined engine
        use_curve_keys(directory.keys())
        deadline = time.monotonic() + 30
        while True:
            try:
                await directory.ref("engine_1").call("__ping__", timeout=1.0)
                break
            except ActorError:
                assert time.monotonic() < deadline, "the rank never served"
        await directory.ref("engine_1").call("__stop__", failure, timeout=5.0)

    asyncio.run(stop())
    thread.join(30)
    assert not thread.is_alive()
    if failure:
        assert [type(e) for e in raised] == [RunFailed]
        assert str(raised[0]) == f"the driver ended the run with a failure: {failure}"
    else:
        assert raised == []
