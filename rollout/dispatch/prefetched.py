"""The prefetched rollout of a checkpoint, as one file.

An asynchronous run checkpoints after a step while the next rollout is already generated (by
the policy one version older than the checkpoint's). Regenerating it after a resume would use
the restored, newer policy and change the run; so the batch itself is stored beside the
trainer's files and handed to the trainer again as it was (docs/configuration.md, Checkpoints).

The file is the transport codec's message of ``{"rollout_id", "summary", "columns"}``
(``replayrl.rollout.sample.samples_to_columns``) with every array inline: one frame, no pickle,
read back with the same limits a received message has.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from replayrl.rollout.errors import RolloutError
from replayrl.rollout.sample import Sample, samples_from_columns, samples_to_columns
from replayrl.transport import Codec, CodecConfig

FILE_NAME = "prefetched_rollout.msgpack"
"""The file's name inside a checkpoint directory."""

_CODEC = Codec(CodecConfig(inline_threshold=2 ** 62))  # every array inline: a single frame


def write_prefetched(path: Path, rollout_id: int, summary: dict, samples: list[Sample]) -> None:
    """Write one generated, untrained batch and its ``generate`` summary to ``path``.

    Args:
        rollout_id: the rollout the batch is (the step that trains it).
        summary: the ``RolloutManager.generate`` result of that rollout (JSON-like values).
        samples: its samples, groups contiguous.
    Raises:
        replayrl.transport.EncodeError / MessageTooLarge: the batch exceeds the codec's limits
            (2 GiB).
    """
    frames = _CODEC.encode({"rollout_id": int(rollout_id), "summary": summary,
                            "columns": samples_to_columns(samples)})
    if len(frames) != 1:  # inline_threshold puts every array in frame 0
        raise RolloutError(f"{path}: the prefetched batch encoded to {len(frames)} frames")
    Path(path).write_bytes(bytes(frames[0]))


def read_prefetched(path: Path) -> tuple[int, dict, list[Sample]]:
    """Read :func:`write_prefetched` output: ``(rollout_id, summary, samples)``.

    Raises:
        FileNotFoundError: no such file.
        RolloutError: the file is not such a message (names the file and what is wrong).
        replayrl.rollout.errors.SampleError: a sample breaks the sample contract.
    """
    data = Path(path).read_bytes()
    try:
        message: Any = _CODEC.decode([data])
    except Exception as exc:  # the codec's DecodeError / MessageTooLarge
        raise RolloutError(f"{path}: not a prefetched rollout: {type(exc).__name__}: {exc}") from None
    if not isinstance(message, dict) or set(message) != {"rollout_id", "summary", "columns"}:
        found = sorted(message) if isinstance(message, dict) else type(message).__name__
        raise RolloutError(f"{path}: not a prefetched rollout (keys {found})")
    return int(message["rollout_id"]), dict(message["summary"]), samples_from_columns(message["columns"])
