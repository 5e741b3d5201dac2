"""What the weight-sync room refuses of a run's settings, and what ``--weight-sync auto`` means.

Light (no torch), as the launcher that checks the run before any process starts. ``auto`` is
the choice every run made before the flag existed: the shared-memory pool for ipc engines when
the pool is on (``--transport ipc``, ``--shm-pool-bytes`` > 0), ZeroMQ frames otherwise
(:func:`resolve`).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from replayrl.rollout.engines.sglang_protocol import parse_urls
from replayrl.rollout.errors import RolloutConfigError

__all__ = ["check_device", "check_run", "resolve", "trainer_spec"]


def resolve(run: Any) -> str:
    """The run's weight sync: ``--weight-sync`` itself, or for ``auto`` ``"shm"`` when the
    engines are ipc peers with a shared-memory pool, else ``"zmq"``.

    Args:
        run: the run's settings (a ``replayrl.tools.run.config.RunConfig``); read:
            ``weight_sync``, ``transport``, ``shm_pool_bytes``.
    """
    if run.weight_sync != "auto":
        return run.weight_sync
    return "shm" if run.transport == "ipc" and run.shm_pool_bytes > 0 else "zmq"


def trainer_spec(run: Any) -> dict[str, Any]:
    """What the trainer builds its half of the run's weight sync from: ``{"name", "settings"}``
    (plain data for its actor spec): the resolved name (:func:`resolve`), the reply timeout
    (``--rpc-timeout-seconds``) every wait on the engines gets, the disk sync's absolute
    directory (``--weight-sync-dir``, default ``<output-dir>/weight-sync``), and the hosts of
    the SGLang servers, whose weight group reaches the trainer at the address facing them.

    Args:
        run: the run's settings (a ``replayrl.tools.run.config.RunConfig``).
    """
    settings: dict[str, Any] = {"timeout_s": float(run.trainer.rpc_timeout_s)}
    name = resolve(run)
    if name == "disk":
        settings["directory"] = str(Path(run.weight_sync_dir or Path(run.output_dir) / "weight-sync")
                                    .absolute())
    if name == "dist" and run.sglang_urls:
        settings["peer_hosts"] = [urlsplit(url).hostname or "" for url in parse_urls(run.sglang_urls)]
    return {"name": name, "settings": settings}


def check_run(run: Any) -> None:
    """Refuse a weight sync the run cannot use, before any process starts.

    Refused: ``shm`` without ipc engines or without a pool; ``dist`` and ``ipc`` with
    ``--colocate`` (engine_0 is the trainer's own process: neither a second member of a
    process group nor a CUDA IPC peer); ``dist`` with SGLang servers beyond ``--num-engines``
    (a spare server would not be in the group); ``ipc`` on ``--device cpu`` and with the
    SGLang engine (its servers are processes replayrl does not hand CUDA handles to).

    Args:
        run: the run's settings (a ``replayrl.tools.run.config.RunConfig``); read:
            ``weight_sync``, ``transport``, ``shm_pool_bytes``, ``colocate``,
            ``rollout_engine``, ``sglang_urls``, ``num_engines``, ``device``.
    Raises:
        RolloutConfigError: the sync and the setting it cannot serve, named, with what to use.
    """
    sync = run.weight_sync
    if sync == "shm":
        if run.transport != "ipc":
            raise RolloutConfigError(f"--weight-sync shm with --transport {run.transport}: "
                                     f"shared memory reaches ipc engines only; use "
                                     f"--weight-sync zmq or auto")
        if run.shm_pool_bytes <= 0:
            raise RolloutConfigError("--weight-sync shm with --shm-pool-bytes 0: the push needs "
                                     "the shared-memory pool; give it room or use --weight-sync zmq")
    if sync in ("dist", "ipc") and run.colocate:
        raise RolloutConfigError(
            f"--weight-sync {sync} with --colocate: engine_0 runs in the trainer's own process, "
            + ("which cannot be a second member of the weight group"
               if sync == "dist" else "where CUDA IPC handles of its own memory do not open")
            + "; use --weight-sync auto (shared memory) or no --colocate")
    if sync == "dist" and run.rollout_engine == "sglang" and run.sglang_urls \
            and len(parse_urls(run.sglang_urls)) > run.num_engines:
        raise RolloutConfigError(
            f"--weight-sync dist with {len(parse_urls(run.sglang_urls))} --sglang-urls for "
            f"--num-engines {run.num_engines}: each engine's server joins the weight group, so "
            f"a spare server would fail over without the weights; give one URL per engine")
    if sync == "ipc":
        if run.rollout_engine == "sglang":
            raise RolloutConfigError("--weight-sync ipc with --rollout-engine sglang: the SGLang "
                                     "client hands its servers weights from disk or a weight "
                                     "group; use --weight-sync dist or disk")
        check_device(sync, run.device)


def check_device(sync: str, device: str, cuda_devices: int = 1) -> None:
    """Refuse ``ipc`` on a device without CUDA IPC: ``--device cpu`` (or ``auto`` resolved to
    the CPU, checked again where the launcher resolves it), or several visible CUDA devices
    (each engine process gets its own, which cannot map the trainer's memory).

    Args:
        sync: the run's weight sync; device: ``"cpu"``, ``"cuda"`` or ``"auto"`` (not yet
            resolved: passes); cuda_devices: the visible CUDA devices.
    Raises:
        RolloutConfigError: names ``--weight-sync ipc`` and the device.
    """
    if sync != "ipc":
        return
    if device == "cpu":
        raise RolloutConfigError("--weight-sync ipc on the CPU: CUDA IPC handles share GPU "
                                 "memory, and this run computes on the CPU (--device); use "
                                 "--weight-sync shm, zmq or dist")
    if device == "cuda" and cuda_devices > 1:
        raise RolloutConfigError(f"--weight-sync ipc with {cuda_devices} visible CUDA devices: "
                                 f"each engine then runs on a device of its own, which cannot "
                                 f"map the trainer's memory; make one device visible "
                                 f"(CUDA_VISIBLE_DEVICES) or use --weight-sync dist")
