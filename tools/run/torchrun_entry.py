"""Distributed launcher: one actor per torchrun rank, the driver on rank 0, on one host or
many.

Usage (one node; several nodes: the same command on each, with torchrun's ``--nnodes``,
``--node-rank``, ``--master-addr`` and ``--master-port``)::

    torchrun --nproc-per-node 4 -m replayrl.tools.run.torchrun_entry --curve-keys DIR [replayrl train flags]

Roles: rank 0 runs the driver loop and serves ``version_clock`` and ``rollout_manager``;
the last ``T = --dp-size x --tp-size x --pp-size x --cp-size`` ranks serve the trainer ranks ``trainer``,
``trainer_1`` .. (docs/design/trainer-ranks.md#trainer-ranks); the ranks between serve ``engine_0 ..``.
The actor with index ``i`` in the run's actor list listens on ``tcp://ADDR:MASTER_PORT + 1 + i``,
where ``ADDR`` is its rank's address toward ``MASTER_ADDR`` (:mod:`replayrl.tools.run.rank_hosts`); the ranks
exchange their addresses through torchrun's rendezvous store, so every rank builds the same
directory (docs/design/multi-host.md#attach-and-multi-host). Every socket is
CURVE-authenticated with the run's keys (``--curve-keys DIR``, made by ``replayrl keys DIR`` and
copied to every host), loopback and network alike.

Engine hosts the run survives losing (docs/design/multi-host.md#attach-and-multi-host): with
``--joined-engines N`` the run also expects ``N`` engines from outside its torchrun world; each such
host runs its own one-node torchrun with ``--join-run MASTER_ADDR:MASTER_PORT`` (the run's) and the
same training flags::

    torchrun --standalone --nproc-per-node K -m replayrl.tools.run.torchrun_entry --curve-keys DIR \
        --join-run node0.example:29500 [the run's replayrl train flags]

Their engines come after the run's own (``engine_{E}`` ..). Rank 0 publishes the run's settings
in the store and a joined host refuses to join when its own differ (:func:`check_joined_settings`;
only :data:`PER_HOST_FLAGS` may differ). A joined host's loss is handled by
``--engine-failure regenerate`` like any lost engine, and no agent of the run's torchrun waits
for it or is stopped with it. Every rank but the driver exits by itself when its connection
to the driver stays lost (:mod:`replayrl.tools.run.driver_watch`). ``--engine-failure restart`` is refused
here: no process of the run can start a replacement on another host.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Callable

from replayrl.actors import ActorError, ActorSpec, Directory, DriverActors, run_event_loop, serve_actor
from replayrl.actors.directory import DEFAULT_HEARTBEAT_DEADLINE_S
from replayrl.actors.objects import import_actor_class
from replayrl.actors.process_title import set_process_title
from replayrl.actors.ref import use_curve_keys, use_heartbeat_deadline
from replayrl.tools.errors import ConfigError, RunFailed
from replayrl.tools.run.attach_card import remove_attach_card, write_attach_card
from replayrl.tools.run.config import RunConfig
from replayrl.tools.run.driver_watch import DriverWatch
from replayrl.tools.run.exit_codes import exit_code
from replayrl.tools.run.flags import FLAGS, add_run_flags
from replayrl.tools.run.from_flags import config_from_args
from replayrl.tools.run.launcher import (
    DRIVER_ACTORS,
    actor_specs,
    check_load,
    check_prompt_data,
    initial_checkpoint,
    resolve_run_device,
    write_embedded_tokenizer,
    write_run_config,
)
from replayrl.tools.run.metrics import MetricsRecorder
from replayrl.tools.run.output_dir import check_output_dir, clear_run
from replayrl.tools.run.rank_hosts import exchange_addresses, join_run, own_address
from replayrl.tools.run.train_loop import checkpoint_next_step, train_loop
from replayrl.trainer.ranks.rank_group import follower_names

PER_HOST_FLAGS = ("output-dir", "save", "curve-keys", "progress", "num-engines")
"""Flags a joined host may set otherwise than the run (:func:`check_joined_settings`): where
its own files go and are read from (its output directory, its checkpoints' directory, its copy
of the CURVE keys), its console, and ``--num-engines``, which the plan decides on every host
(:func:`plan`). Every other flag shapes the model, the engines or the algorithm and must
agree: a joined engine built otherwise fails only later, at the first weight push."""


def plan(world_size: int, config: RunConfig, base_port: int = 29500,
         joined: int = 0) -> tuple[list[ActorSpec], dict[int, list[str]]]:
    """Actor specs of the run and the actor names each rank serves.

    The last ``T`` ranks (``T`` = :attr:`replayrl.trainer.config.TrainerConfig.rank_count`, ``--dp-size``)
    serve the trainer ranks (``trainer``, ``trainer_1`` ..), which meet in their own process
    group at ``base_port + 1 + len(specs)``, the port after the actors'. The ranks between the
    driver and them serve ``engine_0`` .. ``engine_{E-1}``; ``joined`` more engines
    (:func:`joined_engine`) are served from outside the torchrun world.

    The ranks decide the engine count: ``--num-engines`` is accepted when it equals the
    plan's count or is left at its default.

    Raises:
        ConfigError: fewer than ``1 + T`` ranks, no engine at all (neither a rank between
            the driver and the trainer ranks nor a joined one), or a ``--num-engines`` other
            than its default that differs from the plan's count (names both).
    """
    trainers = config.trainer.rank_count
    own_engines = world_size - 1 - trainers
    if own_engines < 0 or own_engines + joined < 1:
        raise ConfigError(f"torchrun needs --nproc-per-node >= {2 + trainers} (driver, "
                          f"engine(s), {trainers} trainer rank(s)), or engines joined with "
                          f"--joined-engines, got {world_size} rank(s) and {joined} joined")
    engines = own_engines + joined
    # an explicit --num-engines cannot be told from the default when both are equal: the
    # default is accepted, anything else must be what the ranks give
    if config.num_engines not in (engines, FLAGS["num-engines"].default):
        raise ConfigError(f"--num-engines {config.num_engines} differs from the {engines} "
                          f"engine(s) the ranks give under torchrun ({world_size} rank(s) - 1 "
                          f"driver - {trainers} trainer rank(s) + {joined} joined); drop "
                          f"--num-engines or change --nproc-per-node / --joined-engines")
    config = dataclasses.replace(config, num_engines=engines)
    actors = len(DRIVER_ACTORS) + engines + trainers
    specs = actor_specs(config, _checkpoint_dir(config), rank_port=base_port + 1 + actors)
    if not config.rollout.tokenizer and not (config.hf_checkpoint and config.rollout.prompt_data):
        # the initial checkpoint is written on the trainer's rank only; the manager's rank
        # reads the embedded tokenizer from its own copy, so neither waits for the other
        specs = [dataclasses.replace(s, kwargs={**s.kwargs, "tokenizer_dir": str(_tokenizer_dir(config))})
                 if s.name == "rollout_manager" else s for s in specs]
    roles = {0: list(DRIVER_ACTORS)}
    roles.update({r: [f"engine_{r - 1}"] for r in range(1, 1 + own_engines)})
    for i, name in enumerate(["trainer", *follower_names(trainers)]):
        roles[1 + own_engines + i] = [name]
    return specs, roles


def joined_engine(world_size: int, config: RunConfig, slot: int) -> str:
    """The engine a joined rank in ``slot`` serves: the run's own engines come first."""
    return f"engine_{world_size - 1 - config.trainer.rank_count + slot}"


def check_joined_settings(run_settings: str, config: RunConfig) -> None:
    """Refuse a joined host whose settings differ from the run's.

    Args:
        run_settings: the run's :meth:`replayrl.tools.run.config.RunConfig.to_json`, as rank 0 publishes it.
        config: the joined host's own settings.
    Raises:
        ConfigError: a flag other than :data:`PER_HOST_FLAGS` differs; names every such flag
            with the run's value and this host's.
    """
    if not run_settings:
        raise ConfigError("--join-run: the run published no settings to compare with (its "
                          "rank 0 runs another replayrl version); use the same version")
    run, own = json.loads(run_settings), json.loads(config.to_json())

    def value(record: dict, section: str | None, field: str):
        return record[field] if section is None else record[section][field]

    differing = [f"--{flag.name} (run: {value(run, *flag.targets[0])!r}, here: "
                 f"{value(own, *flag.targets[0])!r})"
                 for flag in FLAGS.values() if flag.name not in PER_HOST_FLAGS
                 and any(value(run, *t) != value(own, *t) for t in flag.targets)]
    if differing:
        raise ConfigError("--join-run: this host's settings differ from the run's: "
                          + "; ".join(differing) + "; give the run's training flags")


def refuse_restart(config: RunConfig) -> None:
    """Raise :class:`ConfigError` for ``--engine-failure restart``, which torchrun cannot give.

    A restart needs a new process on the lost engine's host, started by the run: under
    torchrun only that host's agent starts processes, and an agent restarts its whole local
    worker group after a new rendezvous of every node of its world (for the run's own world,
    the driver's node too), which would end the run it was meant to save.
    """
    if config.engine_failure == "restart":
        raise ConfigError("--engine-failure restart is not available under torchrun: a new "
                          "engine process would have to be started on the lost engine's host, "
                          "and a torchrun agent restarts only its whole worker group after a "
                          "new rendezvous of every node (the driver's too); use regenerate "
                          "(engine hosts joined with --join-run can be lost) or replayrl train")


def refuse_colocate(config: RunConfig) -> None:
    """Raise :class:`ConfigError` for ``--colocate``: torchrun starts one process per rank, each
    serving the actors its rank plans (:func:`plan`), so the engine and the trainer cannot share
    one (docs/design/actors.md#colocate)."""
    if config.colocate:
        raise ConfigError("--colocate is not available under torchrun: each rank is a process of "
                          "its own serving its planned actors, so engine_0 and the trainer cannot "
                          "share one; use replayrl train --colocate")


def with_trainer_group_host(specs: list[ActorSpec], host: str) -> list[ActorSpec]:
    """``specs`` with the trainer ranks' process group meeting at ``host`` (rank 0 of the
    trainer ranks, the ``trainer`` actor's address), so trainer ranks on other hosts reach it;
    the plan's loopback default holds on one host only."""
    def moved(spec: ActorSpec) -> ActorSpec:
        for key in ("ranks", "group"):
            group = spec.kwargs.get(key) if spec.name.startswith("trainer") else None
            if isinstance(group, dict) and "host" in group:
                return dataclasses.replace(spec, kwargs={**spec.kwargs, key: {**group, "host": host}})
        return spec
    return [moved(s) for s in specs]


def _checkpoint_dir(config: RunConfig):
    """Where the trainer reads the initial policy (``replayrl.tools.run.launcher.initial_checkpoint``)."""
    if config.hf_checkpoint:
        return Path(config.hf_checkpoint)
    return Path(config.output_dir) / "checkpoint-init"


def _tokenizer_dir(config: RunConfig):
    """Where the rollout manager reads the tokenizer: ``--tokenizer``, else the
    ``--hf-checkpoint`` directory, else its own copy of the embedded one (``tokenizer-init``)."""
    if config.rollout.tokenizer:
        return Path(config.rollout.tokenizer)
    if config.hf_checkpoint and config.rollout.prompt_data:
        return Path(config.hf_checkpoint)
    return Path(config.output_dir) / "tokenizer-init"


def directory_for(specs: list[ActorSpec], hosts: dict[str, str], base_port: int,
                  curve_keys: str,
                  heartbeat_deadline_s: float = DEFAULT_HEARTBEAT_DEADLINE_S) -> Directory:
    """``name -> tcp://hosts[name]:base_port + 1 + i`` for the run's actors (``i`` = the
    actor's index in ``specs``), with the run's CURVE key directory (``--curve-keys``) and
    heartbeat deadline (``--heartbeat-deadline-s``). An IPv6 address is written in brackets."""
    def where(name: str) -> str:
        host = hosts[name]
        return f"[{host}]" if ":" in host else host

    return Directory({s.name: f"tcp://{where(s.name)}:{base_port + 1 + i}"
                      for i, s in enumerate(specs)}, curve_keys, heartbeat_deadline_s)


async def _serve_rank(names: list[str], specs: list[ActorSpec], directory: Directory) -> list[str]:
    by_name = {s.name: s for s in specs}
    actors = [import_actor_class(by_name[n].cls)(**by_name[n].kwargs) for n in names]
    return await asyncio.gather(*(serve_actor(a, n, directory, parent_pid=os.getppid())
                                  for a, n in zip(actors, names)))


def _serve_watched(names: list[str], specs: list[ActorSpec], directory: Directory,
                   ready_timeout: float, rank: int | str) -> None:
    """Serve ``names`` until the driver stops them; exit the process if the driver is lost.

    Raises:
        RunFailed: the driver stopped them because the run failed, so that this rank (a
            joined host's too, whose torchrun nothing else tells) exits failed as well.
    """
    watch = DriverWatch(directory, ready_timeout, rank=rank).start()
    try:
        failures = run_event_loop(_serve_rank(names, specs, directory))
    finally:
        watch.close()
    failure = next((f for f in failures if f), "")
    if failure:
        raise RunFailed(f"the driver ended the run with a failure: {failure}")


async def _drive(config: RunConfig, specs: list[ActorSpec], directory: Directory,
                 ready_timeout: float, joined: frozenset[str] = frozenset()) -> str:
    by_name = {s.name: s for s in specs}
    use_curve_keys(directory.keys())  # the driver's own calls are CURVE clients too
    use_heartbeat_deadline(directory.heartbeat_deadline_s)
    local = DriverActors([by_name[n] for n in DRIVER_ACTORS], directory)
    remote = [s.name for s in specs if s.name not in DRIVER_ACTORS]
    failure = ""
    try:
        deadline = time.monotonic() + ready_timeout
        for name in remote:
            while True:
                try:
                    await directory.ref(name).call("__ping__", timeout=1.0)
                    break
                except ActorError as last:
                    if time.monotonic() > deadline:
                        raise ActorError(f"rank serving {name!r} not ready after {ready_timeout} s") from last
        write_attach_card(config.output_dir, directory)  # `replayrl repl --attach` finds the run
        resume = checkpoint_next_step(Path(config.load)) if config.load else None
        with MetricsRecorder(config.output_dir, config.num_steps, config.progress,
                             resume_step=resume) as recorder:
            await local.beside(train_loop(directory, config, recorder.record))
        recorder.plot()
        return recorder.summary()
    except BaseException as exc:
        # joined engines learn that the run failed with their stop, and exit failed too: no
        # agent of the run's torchrun reports for them. The run's own ranks stop as usual (an
        # own rank exiting failed first would have its agent terminate this rank before it
        # reports why); their torchrun fails with rank 0.
        failure = f"{type(exc).__name__}: {exc}".splitlines()[0][:500]
        raise
    finally:
        remove_attach_card(config.output_dir, directory)
        for name in remote:
            try:
                await directory.ref(name).call("__stop__", failure if name in joined else "",
                                               timeout=5.0)
            except ActorError:
                pass
        await local.stop()


def main(argv: list[str] | None = None,
         transform_specs: Callable[[list[ActorSpec]], list[ActorSpec]] | None = None) -> int:
    """Entry point of one torchrun rank; exit codes as :func:`replayrl.tools.run.exit_codes.exit_code`
    (and :data:`replayrl.tools.run.exit_codes.EXIT_DRIVER_LOST` from :mod:`replayrl.tools.run.driver_watch`).

    ``transform_specs`` rewrites the planned actor specs on every rank (tests inject faulty
    actors this way, as ``replayrl.tools.run.launcher.launch(specs=...)``).
    """
    parser = argparse.ArgumentParser(prog="python -m replayrl.tools.run.torchrun_entry",
                                     description=__doc__.splitlines()[0])
    add_run_flags(parser)
    parser.add_argument("--ready-timeout", type=float, default=180.0, metavar="SECONDS",
                        help="how long the ranks (and joined engines) may take to publish their "
                             "addresses and answer, and a rank to first reach the driver "
                             "(default: 180)")
    parser.add_argument("--joined-engines", type=int, default=0, metavar="N",
                        help="engines served by hosts that join with --join-run (the run's "
                             "ranks wait for them at start)")
    parser.add_argument("--join-run", default="", metavar="HOST:PORT",
                        help="serve engines of the run whose torchrun MASTER_ADDR:MASTER_PORT "
                             "this is, from this host's own torchrun")
    args = parser.parse_args(argv)
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    host, port = os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ.get("MASTER_PORT", "29500"))
    who = f"joined {rank}" if args.join_run else str(rank)
    logging.basicConfig(level=logging.WARNING, format=f"%(asctime)s rank{who} %(levelname)s %(message)s")

    def run() -> int:
        config = config_from_args(args)
        refuse_restart(config)
        refuse_colocate(config)
        resolve_run_device(config)  # --device cuda where this host has none: refused here
        if not args.join_run:
            if args.joined_engines < 0:
                raise ConfigError(f"--joined-engines must be >= 0, got {args.joined_engines}")
            # a bad layout fails before all else
            specs, roles = plan(world, config, port, args.joined_engines)
            if config.load:  # every rank, as the launcher: a checkpoint of another backend or
                check_load(config)  # layout fails here on all ranks alike, not in load_checkpoint
            check_output_dir(config)  # an earlier run in it: each rank of that host refuses
        if not config.curve_keys:
            raise ConfigError("torchrun ranks talk over tcp: pass --curve-keys DIR (made by "
                              "`replayrl keys DIR`)")
        if args.join_run:
            run_host, _, run_port = args.join_run.rpartition(":")
            if not run_host or not run_port.isdigit():
                raise ConfigError(f"--join-run {args.join_run!r}: expected HOST:PORT")
            base = int(run_port)
            joined = join_run(run_host.strip("[]"), base, own_address(run_host.strip("[]"), base),
                              args.ready_timeout,
                              check=lambda settings: check_joined_settings(settings, config))
            world_size, joined_count, addresses = joined.world_size, joined.joined, joined.addresses
            mine = [joined_engine(world_size, config, joined.slot)]
            specs, roles = plan(world_size, config, base, joined_count)
        else:
            base, world_size, joined_count = port, world, args.joined_engines
            addresses = exchange_addresses(rank, world, own_address(host, port), args.ready_timeout,
                                           joined_count, settings=config.to_json())
            mine = None
        if transform_specs is not None:
            specs = transform_specs(specs)
        if mine is None:
            mine = roles[rank]
        hosts = {name: addresses[r] for r, names in roles.items() for name in names}
        hosts.update({joined_engine(world_size, config, j): addresses[world_size + j]
                      for j in range(joined_count)})
        specs = with_trainer_group_host(specs, hosts["trainer"])
        directory = directory_for(specs, hosts, base, config.curve_keys,
                                  config.heartbeat_deadline_s)
        if "trainer" in mine:
            # only the trainer ranks read it (_checkpoint_dir, which the plan gives them);
            # rank 0 of them writes it, the others wait for it in the group's rendezvous
            initial_checkpoint(config, Path(config.output_dir))
        if "rollout_manager" in mine:
            tokenizer = _tokenizer_dir(config)
            if tokenizer == Path(config.output_dir) / "tokenizer-init":
                write_embedded_tokenizer(tokenizer)  # the embedded tokenizer, its own copy
            check_prompt_data(config, tokenizer)  # a bad row stops the run before it starts
        # `ps` tells the ranks apart (rank 0: the driver loop and its two actors)
        set_process_title("driver" if "version_clock" in mine else "+".join(mine), config.output_dir)
        if "version_clock" in mine:
            if config.overwrite:  # the earlier run's metrics and checkpoints, before any new one
                clear_run(config)
            # the run's record, as `replayrl train` writes it, with the engines the ranks give
            write_run_config(dataclasses.replace(config, num_engines=len(
                [s for s in specs if s.name.startswith("engine_")])), Path(config.output_dir))
            joined_names = frozenset(joined_engine(world_size, config, j) for j in range(joined_count))
            print(run_event_loop(_drive(config, specs, directory, args.ready_timeout, joined_names)))
        else:
            _serve_watched(mine, specs, directory, args.ready_timeout, who)
        return 0

    return exit_code(run, prog=f"replayrl[rank {who}]")


if __name__ == "__main__":
    sys.exit(main())
