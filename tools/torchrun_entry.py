"""Distributed launcher: one actor per torchrun rank, the driver on rank 0, on one host or
many.

Usage (one node; several nodes: the same command on each, with torchrun's ``--nnodes``,
``--node-rank``, ``--master-addr`` and ``--master-port``)::

    torchrun --nproc-per-node 4 -m tools.torchrun_entry --curve-keys DIR [replayrl train flags]

Roles: rank 0 runs the driver loop and serves ``version_clock`` and ``rollout_manager``;
the last ``T = --dp-size x --tp-size`` ranks serve the trainer ranks ``trainer``,
``trainer_1`` .. (docs/design.md §19 "Trainer ranks"); the ranks between serve ``engine_0 ..``.
The actor with index ``i`` in the run's actor list listens on ``tcp://ADDR:MASTER_PORT + 1 + i``,
where ``ADDR`` is its rank's address toward ``MASTER_ADDR`` (:mod:`tools.rank_hosts`); the ranks
exchange their addresses through torchrun's rendezvous store, so every rank builds the same
directory (docs/design.md §21 "REPL attach and multi-host runs"). Every socket is
CURVE-authenticated with the run's keys (``--curve-keys DIR``, made by ``replayrl keys DIR`` and
copied to every host), loopback and network alike.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import sys
import time
from pathlib import Path

from actors import ActorError, Directory, run_event_loop
from actors.directory import DEFAULT_HEARTBEAT_DEADLINE_S
from actors.process_title import set_process_title
from actors.ref import use_curve_keys, use_heartbeat_deadline
from actors.spawn import ActorSpec, import_actor_class, serve_actor
from tools.attach import remove_attach_card, write_attach_card
from tools.config import ConfigError, RunConfig, add_run_flags, config_from_args
from tools.exit_codes import exit_code
from tools.launcher import (actor_specs, check_prompt_data, initial_checkpoint, trainer_rank_count,
                            write_embedded_tokenizer)
from trainer.rank_group import follower_names
from tools.metrics import MetricsRecorder
from tools.rank_hosts import exchange_addresses, own_address
from tools.train_loop import checkpoint_next_step, train_loop

DRIVER_ACTORS = ("version_clock", "rollout_manager")


def plan(world_size: int, config: RunConfig,
         base_port: int = 29500) -> tuple[list[ActorSpec], dict[int, list[str]]]:
    """Actor specs of the run and the actor names each rank serves.

    The last ``T`` ranks (``T`` = :func:`tools.launcher.trainer_rank_count`, ``--dp-size``)
    serve the trainer ranks (``trainer``, ``trainer_1`` ..), which meet in their own process
    group at ``base_port + 1 + len(specs)``, the port after the actors'.

    Raises:
        ConfigError: fewer than ``2 + T`` ranks (driver, one engine, the trainer ranks).
    """
    trainers = trainer_rank_count(config)
    if world_size < 2 + trainers:
        raise ConfigError(f"torchrun needs --nproc-per-node >= {2 + trainers} (driver, "
                          f"engine(s), {trainers} trainer rank(s)), got {world_size}")
    engines = world_size - 1 - trainers
    config = dataclasses.replace(config, num_engines=engines)
    actors = len(DRIVER_ACTORS) + engines + trainers
    specs = actor_specs(config, _checkpoint_dir(config), rank_port=base_port + 1 + actors)
    if not config.rollout.tokenizer and not (config.hf_checkpoint and config.rollout.prompt_data):
        # the initial checkpoint is written on the trainer's rank only; the manager's rank
        # reads the embedded tokenizer from its own copy, so neither waits for the other
        specs = [dataclasses.replace(s, kwargs={**s.kwargs, "tokenizer_dir": str(_tokenizer_dir(config))})
                 if s.name == "rollout_manager" else s for s in specs]
    roles = {0: list(DRIVER_ACTORS)}
    roles.update({r: [f"engine_{r - 1}"] for r in range(1, 1 + engines)})
    for i, name in enumerate(["trainer", *follower_names(trainers)]):
        roles[1 + engines + i] = [name]
    return specs, roles


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
    """Where the trainer reads the initial policy (``tools.launcher.initial_checkpoint``)."""
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


async def _serve_rank(names: list[str], specs: list[ActorSpec], directory: Directory) -> None:
    by_name = {s.name: s for s in specs}
    actors = [import_actor_class(by_name[n].cls)(**by_name[n].kwargs) for n in names]
    await asyncio.gather(*(serve_actor(a, n, directory, parent_pid=os.getppid())
                           for a, n in zip(actors, names)))


async def _drive(config: RunConfig, specs: list[ActorSpec], directory: Directory,
                 ready_timeout: float) -> str:
    by_name = {s.name: s for s in specs}
    use_curve_keys(directory.keys())  # the driver's own calls are CURVE clients too
    use_heartbeat_deadline(directory.heartbeat_deadline_s)
    local = [asyncio.ensure_future(serve_actor(import_actor_class(by_name[n].cls)(**by_name[n].kwargs), n,
                                               directory)) for n in DRIVER_ACTORS]
    remote = [s.name for s in specs if s.name not in DRIVER_ACTORS]
    try:
        deadline = time.monotonic() + ready_timeout
        for name in remote:
            while True:
                try:
                    await directory.ref(name).call("__ping__", timeout=1.0)
                    break
                except ActorError:
                    if time.monotonic() > deadline:
                        raise ActorError(f"rank serving {name!r} not ready after {ready_timeout} s")
        write_attach_card(config.output_dir, directory)  # `replayrl repl --attach` finds the run
        resume = checkpoint_next_step(Path(config.load)) if config.load else None
        with MetricsRecorder(config.output_dir, config.num_steps, config.progress,
                             resume_step=resume) as recorder:
            await train_loop(directory, config, recorder.record)
        recorder.plot()
        return recorder.summary()
    finally:
        remove_attach_card(config.output_dir, directory)
        for name in [*remote, *DRIVER_ACTORS]:
            try:
                await directory.ref(name).call("__stop__", timeout=5.0)
            except ActorError:
                pass
        await asyncio.gather(*local, return_exceptions=True)


def main(argv: list[str] | None = None) -> int:
    """Entry point of one torchrun rank; exit codes as :func:`tools.exit_codes.exit_code`."""
    parser = argparse.ArgumentParser(prog="python -m tools.torchrun_entry", description=__doc__.splitlines()[0])
    add_run_flags(parser)
    parser.add_argument("--ready-timeout", type=float, default=180.0)
    args = parser.parse_args(argv)
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    host, port = os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ.get("MASTER_PORT", "29500"))
    logging.basicConfig(level=logging.WARNING, format=f"%(asctime)s rank{rank} %(levelname)s %(message)s")

    def run() -> int:
        config = config_from_args(args)
        specs, roles = plan(world, config, port)
        if not config.curve_keys:
            raise ConfigError("torchrun ranks talk over tcp: pass --curve-keys DIR (made by "
                              "`replayrl keys DIR`)")
        addresses = exchange_addresses(rank, world, own_address(host, port), args.ready_timeout)
        hosts = {name: addresses[r] for r, names in roles.items() for name in names}
        specs = with_trainer_group_host(specs, hosts["trainer"])
        directory = directory_for(specs, hosts, port, config.curve_keys,
                                  config.heartbeat_deadline_s)
        if "trainer" in roles[rank]:
            # only the trainer ranks read it (_checkpoint_dir, which the plan gives them);
            # rank 0 of them writes it, the others wait for it in the group's rendezvous
            initial_checkpoint(config, Path(config.output_dir))
        if "rollout_manager" in roles[rank]:
            tokenizer = _tokenizer_dir(config)
            if tokenizer == Path(config.output_dir) / "tokenizer-init":
                write_embedded_tokenizer(tokenizer)  # the embedded tokenizer, its own copy
            check_prompt_data(config, tokenizer)  # a bad row stops the run before it starts
        # `ps` tells the ranks apart (rank 0: the driver loop and its two actors)
        set_process_title("driver" if rank == 0 else "+".join(roles[rank]), config.output_dir)
        if rank == 0:
            print(run_event_loop(_drive(config, specs, directory, args.ready_timeout)))
        else:
            run_event_loop(_serve_rank(roles[rank], specs, directory))
        return 0

    return exit_code(run, prog=f"replayrl[rank {rank}]")


if __name__ == "__main__":
    sys.exit(main())
