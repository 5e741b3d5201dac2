"""Large arrays between processes of one node through a reused, pre-faulted shared-memory pool.

docs/design/transport.md#shm-transport. A ZeroMQ frame of a large array costs two
copies into freshly allocated memory (the sender's ownership copy and libzmq's receive
buffer), and every page of both faults on first touch: ~0.07x of a memcpy at 64 MiB. Here the
sender copies the array once into a *slot* of its :class:`ShmPool` (memory that was faulted in
when the slot was made and is reused for later messages), ZeroMQ carries only the header with
a *handle* ``[pid, fd, token, generation]``, and the receiver's :class:`ShmReader` maps the slot
(once per slot; pre-faulted with ``MAP_POPULATE`` below 16 MiB, see "Receiver pages") and hands
out arrays over it without copying.

Slots
-----
A slot is one ``memfd`` (``memfd_create``: anonymous shared memory, freed by the kernel when
the last process closes or unmaps it, so nothing is left behind by a killed process, unlike a
``/dev/shm`` file). Its first page is a header of five little-endian uint64 words: ``token``
(random, identifies the slot), ``capacity`` (data bytes), ``generation`` (written by the
sender each time it fills the slot), ``released`` (written by the one receiver of that
message when it is done, or by the sender for a message nobody can read: "Lifetime") and
``reader`` (``start << 22 | pid`` of the process that decoded this generation, 0 until one
did; reset by the sender before it writes a new generation). The data starts at byte 4096. A
slot is free when ``released == generation``; each word has one writer at a time, so no lock
or atomic read-modify-write is needed (aligned 8-byte stores are atomic on x86-64 and aarch64,
and the receiver's release is written long after its reads of the slot). Both sides of a run
are the same replayrl (one install; every process starts from it), so the header changes only
together; a reader that never wrote ``reader`` would only lose the "reader gone" rule.

The receiver opens a slot as ``/proc/<pid>/fd/<fd>``: only a process of the same user in the
same pid namespace can, which is why the pool is used for ``ipc://`` peers only (ipc sockets
live in a directory of mode 0700, so an ipc peer is this user on this node already).

Lifetime
--------
A decoded array is a view of the slot, never a copy: an :class:`_Lease` object is the base of
every array built from it (``__array_interface__``, so numpy's base-collapsing keeps it), and
when the last view of it is dropped, ``_Lease.__del__`` writes ``released``. A receiver that
keeps an array keeps the slot; the sender then makes another slot, up to ``max_bytes``, and
past that sends arrays as ordinary ZeroMQ frames. So a slot is never rewritten while any
view of it exists, and holding arrays costs only the pool's growth. A slot also comes back
once nobody can ever read its message:

* never sent: a message dropped before a socket took it releases its slots when collected
  (:class:`ShmHeader`), or at once through :meth:`ShmHeader.discard` when its call failed or
  was cancelled first (a kept exception's traceback would hold it until the cyclic collector).
* refused: a message whose decode fails releases every slot its header names, as far as its
  msgpack reads (:meth:`ShmReader.release`: the header words through ``/proc/<pid>/fd/<fd>``,
  nothing mapped; a slot this process still views is left alone).
* reader gone: the receiver writes ``reader`` (its pid and start time, ``/proc/<pid>/stat``
  field 22) when it builds an array over the slot. A sender that needs a slot and has none
  free takes back a busy one whose reader no longer exists: no such pid, a zombie, or that
  pid with another start time (reused). The kernel unmapped its views with it. (A child the
  reader forked while holding a view would be missed; no replayrl process does.)
* never delivered: a :class:`replayrl.transport.sockets.DealerSocket` numbers its messages and
  its owner reports the reply to message ``n`` (``peer_read``); every earlier one whose slots
  no reader stamped is released (:func:`release_unread`). A DEALER has one ordered pipe per
  endpoint, which libzmq keeps across reconnects: a message still queued when the peer died
  goes to the peer's next process before any later one, and one that had left the pipe went
  down with the dead connection. So once a later message was answered, an earlier one was
  decoded (stamped: the rule above) or will never be. A lost or closed connection proves
  nothing (its pipe may still deliver), so it releases nothing.

What stays busy: a reply (an actor's ROUTER sends it) whose caller died before reading it,
until the actor exits; an actor's callers in a run are the launcher and the trainer, whose
loss ends the run. A free slot unused for :data:`IDLE_SLOT_SECONDS` is closed when another of
its size is filled, so the pool shrinks after a burst; a receiver, when it maps a new slot,
forgets cached mappings no lease uses whose sender exited or closed that slot (each holds the
slot's memory and a descriptor: ``mmap`` keeps a duplicate of the fd).

Receiver pages
--------------
Every page a receiver has mapped counts in its RSS as well as in the sender's, though it is
one page of memory. A slot of at least 16 MiB (a weight push: ~190 MiB at the 50m preset) is
therefore never pre-faulted by the receiver: its pages are mapped as they are read (the kernel
maps a 64 KiB block per read fault), and a reader that copies it out once, array by array (an
engine loading a push into its parameters), wraps each copy in :func:`read_once`, which drops
the array's pages from this process after the copy (``MADV_DONTNEED``, which on shared memory
drops page-table entries and leaves the contents to the sender), so the load holds about one
array's pages at a time instead of the whole push. (Mapping each array in one
``MADV_POPULATE_READ`` first was slower than the faults: 121 against 112 ms for the 50m push.)
When the last lease of such a slot is dropped the receiver drops whatever pages of it are
still mapped. Smaller slots (rollouts) are pre-faulted and stay mapped: their messages come
often and their pages are few.

Send buffers
------------
A sender that builds a large array only to send it (the trainer's weight push: every weight
concatenated into one buffer) can build it in a slot instead (:meth:`ShmPool.buffer`): the
slot is *held* while any view of that buffer lives, and the first message that sends the
whole buffer carries the slot's handle without copying it. So the push costs no buffer of its
own beside the slot (at the 50m preset such a buffer is 178 MiB of the trainer's peak, kept
until the engines have loaded it: docs/benchmarks.md#peer-grid). A later message sending the same
buffer (a second engine) gets a copy in another slot, as any array does: a slot has one
receiver. A held slot is free again once its receiver released it and the buffer is dropped.

A send buffer may be sent by handle again after its owner changed it (the trainer's
parameters live in one, and each push sends it anew): :func:`buffer_in_use` says whether the
receiver of its last handed message may still read it (the owner must not write it then), and
:func:`renew_buffer` gives the slot a new generation once it is not, so the next message
carries it by handle again.
"""
from __future__ import annotations

import mmap
import os
import secrets
import stat
import threading
import time
from typing import Any

import numpy as np

from replayrl.transport.errors import DecodeError, TransportError

__all__ = ["ShmPool", "ShmReader", "ShmHeader", "DEFAULT_SHM_POOL_BYTES", "DEFAULT_SHM_MIN_ARRAY_BYTES",
           "IDLE_SLOT_SECONDS", "mark_sent", "release_unread", "buffer_in_use", "renew_buffer", "read_once",
           "process_start", "reader_word", "reader_gone"]

DEFAULT_SHM_POOL_BYTES = 1 << 30
"""Most bytes of slots one process keeps (its sends; receivers map, never allocate); unit: bytes."""

DEFAULT_SHM_MIN_ARRAY_BYTES = 64 << 10
"""Arrays of at least this many bytes go through the pool to an ipc peer; smaller ones travel in
the ZeroMQ message (inline below the codec's 16 KiB threshold, else a frame); unit: bytes."""

IDLE_SLOT_SECONDS = 60.0
"""A free slot left unused this long is closed when another slot of its size is filled, so a pool
shrinks back after a burst of busy slots (a receiver that held messages, one that died); unit:
seconds."""

_HEADER = 4096  # one page: the data stays page aligned
_MIN_SLOT = 64 << 10
_TOKEN, _CAPACITY, _GENERATION, _RELEASED, _READER = range(5)
_WORDS = 5  # header words mapped (the rest of the header page is unused)
_MEMFD_NAME = "replayrl-shm"  # /proc/<pid>/fd/<fd> of a slot reads "/memfd:replayrl-shm (deleted)"
_PID_BITS = 22
_MAX_PID = 1 << _PID_BITS  # Linux's pid_max ceiling: a reader word is start_time << 22 | pid
_MAX_FD = 1 << 20


_FINE_CLASSES_FROM = 16 << 20
# from here on a size class is a multiple of 1/8 of the array's power of two, not the next power
# of two: a slot is pre-faulted and mapped by sender and receiver, so a 186 MiB weight push (the
# 50m model) held 256 MiB resident in each; the classes below it stay coarse so that messages of
# varying sizes (rollouts) reuse few slots


def _slot_capacity(nbytes: int) -> int:
    """The size class of an array of ``nbytes``: a power of two, at least 64 KiB, below 16 MiB;
    from 16 MiB a multiple of 1/8 of the largest power of two <= ``nbytes`` (at most 1/8 unused)."""
    if nbytes < _FINE_CLASSES_FROM:
        return max(_MIN_SLOT, 1 << (nbytes - 1).bit_length())
    step = 1 << (nbytes.bit_length() - 4)
    return -(-nbytes // step) * step


class _Slot:
    """One memfd of the sender's pool, mapped and pre-faulted."""

    __slots__ = ("fd", "token", "capacity", "mm", "data", "words", "generation", "held", "handed", "filled_at")

    def __init__(self, capacity: int) -> None:
        self.fd = os.memfd_create(_MEMFD_NAME, os.MFD_CLOEXEC)
        try:
            os.ftruncate(self.fd, _HEADER + capacity)
            self.mm = mmap.mmap(self.fd, _HEADER + capacity)
        except OSError:
            os.close(self.fd)
            raise
        whole = np.frombuffer(self.mm, dtype=np.uint8)
        whole.fill(0)  # fault every page in now, once, not on the first message
        self.words = whole[:8 * _WORDS].view("<u8")
        self.data = whole[_HEADER:]
        self.token = secrets.randbits(62) + 1
        self.capacity = capacity
        self.generation = 0
        self.held = False  # a send buffer (ShmPool.buffer) over this slot is alive
        self.handed = False  # this generation's handle went into a message
        self.filled_at = time.monotonic()  # when its last message was written: idle slots close
        self.words[_TOKEN] = self.token
        self.words[_CAPACITY] = capacity

    @property
    def free(self) -> bool:
        return not self.held and int(self.words[_RELEASED]) == self.generation

    def close(self) -> None:
        self.words = self.data = None  # drop the exports of mm first
        self.mm.close()
        os.close(self.fd)


class ShmHeader(bytes):
    """Frame 0 of a message whose arrays are in pool slots: the msgpack header, plus the slots it
    holds. If it is dropped before :func:`mark_sent` (the call was never sent: a refused
    argument check, a closed socket, a cancelled caller), its slots are released here."""

    def __new__(cls, header: bytes, slots: list) -> "ShmHeader":
        self = super().__new__(cls, header)
        self.slots = slots  # [(slot, generation), ...]
        self.sent = False
        self.discarded = False
        return self

    def discard(self) -> None:
        """Release now the slots of a message that will never be sent (its call failed or was
        cancelled before it reached a socket), not when this object is collected: an exception's
        traceback can keep it alive until the cyclic garbage collector runs, and a weight push
        with it. A socket refuses to send it afterwards. No effect once sent; idempotent."""
        if not self.sent and not self.discarded:
            self.discarded = True
            self.__del__()
            self.slots = []

    def __del__(self, _released: int = _RELEASED) -> None:  # bound now: also runs at exit
        if not self.sent:
            for slot, generation in self.slots:
                if slot.words is not None and slot.generation == generation:
                    slot.words[_released] = generation


def mark_sent(frames: list) -> None:
    """Record that ``frames`` went to ZeroMQ: the slots of every :class:`ShmHeader` among them
    (a message's frame 0, or the frames of the messages in one batch) now belong to the
    receiver."""
    for f in frames:
        if type(f) is ShmHeader:
            f.sent = True


def release_unread(slots: list) -> int:
    """Release the slots of a sent message that no process can receive any more (the peer
    answered a later message on the same ordered connection: module docstring, "Lifetime") and
    that no reader stamped, i.e. nobody decoded; a stamped slot is left to its reader.

    Args:
        slots: a :class:`ShmHeader`'s ``slots``, ``[(slot, generation), ...]``.
    Returns:
        how many slots were released here.
    """
    count = 0
    for slot, generation in slots:
        words = slot.words
        if (words is not None and slot.generation == generation and int(words[_RELEASED]) != generation
                and int(words[_READER]) == 0):
            words[_RELEASED] = generation
            count += 1
    return count


def process_start(pid: int) -> int | None:
    """The start time of live process ``pid`` (clock ticks after boot: ``/proc/<pid>/stat``
    field 22), or None when it has exited (no entry, or a zombie, whose mappings are gone).

    Raises:
        OSError: ``/proc/<pid>/stat`` exists but cannot be read.
    """
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    fields = data[data.rindex(b")") + 2:].split()  # the name (field 2) may hold spaces and ')'
    if fields[0] in (b"Z", b"X"):
        return None
    return int(fields[19])


def reader_word(pid: int, start: int) -> int:
    """The header word a reader writes when it decodes a slot's message: ``start << 22 | pid``
    (``start`` as :func:`process_start` gives it), so that a recycled pid is told apart."""
    return start << _PID_BITS | pid


def reader_gone(word: int) -> bool:
    """Whether the reader that wrote ``word`` (:func:`reader_word`) has exited: its pid names no
    live process, or one started at another time (the pid was reused). A process whose state
    cannot be read counts as alive."""
    pid, start = word & (_MAX_PID - 1), word >> _PID_BITS
    try:
        now = process_start(pid)
    except (OSError, ValueError, IndexError):
        return False
    return now is None or now != start


def _release_if_reader_gone(slot: _Slot) -> bool:
    """Release a busy slot whose message was decoded by a process that has exited since: the
    kernel unmapped it with the process, so no view of it is left (module docstring,
    "Lifetime"). True when released here."""
    generation, words = slot.generation, slot.words
    if words is None or int(words[_RELEASED]) == generation:
        return False
    word = int(words[_READER])  # reset before this generation was written: this message's reader
    if word == 0 or not reader_gone(word):
        return False
    words[_RELEASED] = generation
    return True


class _Hold:
    """The base object of a send buffer (:meth:`ShmPool.buffer`) and of every view of it; when
    the last one is dropped the slot is no longer held, and a slot whose handle was never sent
    is released here (module docstring, "Send buffers")."""

    __slots__ = ("__array_interface__", "slot", "generation", "__weakref__")

    def __del__(self, _released: int = _RELEASED) -> None:  # bound now: also runs at exit
        slot = self.slot
        if slot.words is not None and slot.generation == self.generation:
            if not slot.handed:
                slot.words[_released] = self.generation
            slot.held = False


def _hold_of(buffer: np.ndarray) -> _Hold | None:
    """The :class:`_Hold` behind ``buffer`` (any view of a send buffer), else None."""
    hold = buffer.base
    while type(hold) is np.ndarray:  # numpy stops collapsing bases at a non-array owner
        hold = hold.base
    return hold if type(hold) is _Hold else None


def buffer_in_use(buffer: np.ndarray) -> bool:
    """Whether a receiver may still read the send buffer ``buffer`` (:meth:`ShmPool.buffer`, or
    any view of one): its slot's handle went into a message whose receiver has not released it
    yet. The owner must not write the buffer while this holds. False for any other array."""
    hold = _hold_of(buffer)
    if hold is None:
        return False
    slot = hold.slot
    return (slot.handed and slot.words is not None and slot.generation == hold.generation
            and int(slot.words[_RELEASED]) != slot.generation and not _release_if_reader_gone(slot))


def renew_buffer(buffer: np.ndarray) -> None:
    """After the owner changed send buffer ``buffer``: give its slot a new generation, so the
    next message carrying it whole sends it by handle again (module docstring, "Send
    buffers").

    Raises:
        TransportError: ``buffer`` is no send buffer, or a receiver may still read it
            (:func:`buffer_in_use`).
    """
    hold = _hold_of(buffer)
    if hold is None:
        raise TransportError("renew_buffer: the array is not a send buffer (ShmPool.buffer)")
    if buffer_in_use(buffer):
        raise TransportError("renew_buffer: a receiver may still read the send buffer")
    slot = hold.slot
    slot.words[_READER] = 0
    slot.generation += 1
    slot.words[_GENERATION] = slot.generation
    slot.handed = False
    hold.generation = slot.generation


class ShmPool:
    """The sending side: slots of reused, pre-faulted shared memory (see the module docstring).

    Args:
        max_bytes: most bytes of slot data this pool keeps; 0 disables it; bytes, >= 0.
        min_array_bytes: arrays below this go in the ZeroMQ message instead; bytes, >= 1.

    Raises:
        TransportError: a negative size, or ``min_array_bytes`` < 1.
    """

    def __init__(self, max_bytes: int = DEFAULT_SHM_POOL_BYTES,
                 min_array_bytes: int = DEFAULT_SHM_MIN_ARRAY_BYTES) -> None:
        if type(max_bytes) is not int or max_bytes < 0:
            raise TransportError(f"ShmPool max_bytes must be an int >= 0, got {max_bytes!r}")
        if type(min_array_bytes) is not int or min_array_bytes < 1:
            raise TransportError(f"ShmPool min_array_bytes must be an int >= 1, got {min_array_bytes!r}")
        self.max_bytes = max_bytes
        self.min_array_bytes = min_array_bytes
        self.pid = os.getpid()
        self._slots: dict[int, list[_Slot]] = {}  # capacity -> slots (most recently used last)
        self._bytes = 0
        self._lock = threading.Lock()  # messages may be encoded in any thread (a REPL's)

    @property
    def slot_bytes(self) -> int:
        """Bytes of slot data made so far (at most ``max_bytes``)."""
        return self._bytes

    def busy(self) -> int:
        """Slots whose last message has not been released yet."""
        return sum(not s.free for slots in self._slots.values() for s in slots)

    def put(self, flat_u8: np.ndarray) -> tuple[list[int], tuple[_Slot, int]] | None:
        """Copy ``flat_u8`` (1-D C-contiguous uint8) into a free slot.

        Returns:
            ``(handle, (slot, generation))``: the handle ``[pid, fd, token, generation]`` the
            header carries, and what :class:`ShmHeader` needs to release an unsent slot; or
            None when the array is too small, or no slot is free and ``max_bytes`` allows no
            new one (the caller then sends a ZeroMQ frame).
        """
        nbytes = flat_u8.nbytes
        if nbytes < self.min_array_bytes or os.getpid() != self.pid:  # a forked child: not ours
            return None
        with self._lock:
            held = self._held_slot(flat_u8)
            if held is not None:  # a send buffer, sent whole for the first time: no copy
                held.handed = True
                return [self.pid, held.fd, held.token, held.generation], (held, held.generation)
            slot = self._take(_slot_capacity(nbytes))
        if slot is None:
            return None
        np.copyto(slot.data[:nbytes], flat_u8)  # the one copy: the message owns its bytes now
        return [self.pid, slot.fd, slot.token, slot.generation], (slot, slot.generation)

    def buffer(self, nbytes: int) -> np.ndarray | None:
        """A writable 1-D uint8 array of ``nbytes`` in a slot of this pool, for the caller to
        fill and then send: the first message that carries the whole array (any dtype view of
        it, from its first byte) sends the slot without copying (module docstring, "Send
        buffers"). Its contents are not zeroed.

        Returns:
            the array; None when ``nbytes`` is below ``min_array_bytes`` or ``max_bytes``
            allows no slot for it (the caller then allocates an ordinary array).
        """
        if nbytes < self.min_array_bytes or os.getpid() != self.pid:
            return None
        with self._lock:
            slot = self._take(_slot_capacity(nbytes))
            if slot is None:
                return None
            slot.held, slot.handed = True, False
        hold = _Hold()
        hold.slot, hold.generation = slot, slot.generation
        hold.__array_interface__ = {"data": (slot.data.ctypes.data, False), "shape": (nbytes,),
                                    "typestr": "|u1", "version": 3}
        return np.asarray(hold)

    @staticmethod
    def _held_slot(flat_u8: np.ndarray) -> _Slot | None:
        """The held slot of the send buffer ``flat_u8`` is, whole and from its first byte, if its
        handle has not gone into a message yet; else None."""
        hold = _hold_of(flat_u8)
        if hold is None:
            return None
        slot = hold.slot
        if (slot.handed or slot.words is None or slot.generation != hold.generation
                or flat_u8.ctypes.data != slot.data.ctypes.data):
            return None
        return slot

    def _take(self, capacity: int) -> _Slot | None:
        slots = self._slots.setdefault(capacity, [])
        for i in range(len(slots) - 1, -1, -1):  # most recently used first: its pages are warm
            slot = slots[i]
            if slot.free:
                slots.append(slots.pop(i))
                return self._fill(slot)
        for i in range(len(slots) - 1, -1, -1):  # none free: a busy one whose reader has exited
            slot = slots[i]
            if _release_if_reader_gone(slot) and slot.free:
                slots.append(slots.pop(i))
                return self._fill(slot)
        if capacity > self.max_bytes:
            return None
        while self._bytes + capacity > self.max_bytes:
            if not self._evict_free(capacity):
                return None
        try:
            slot = _Slot(capacity)
        except OSError:  # no memfd or no memory: frames still work
            return None
        slots.append(slot)
        self._bytes += capacity
        return self._fill(slot)

    def _evict_free(self, keep: int) -> bool:
        """Close one free slot of another size class (the least recently used); False if none."""
        for capacity, slots in self._slots.items():
            if capacity == keep:
                continue
            for i, slot in enumerate(slots):
                if slot.free:
                    slots.pop(i).close()
                    self._bytes -= capacity
                    return True
        return False

    def _fill(self, slot: _Slot) -> _Slot:
        slot.words[_READER] = 0  # before the new generation: a stamp seen later is its reader's
        slot.generation += 1
        slot.words[_GENERATION] = slot.generation
        slot.filled_at = now = time.monotonic()
        slots = self._slots[slot.capacity]
        for i in range(len(slots) - 2, -1, -1):  # least recently used first, never the new one
            idle = slots[i]
            if now - idle.filled_at <= IDLE_SLOT_SECONDS:
                continue
            if not idle.free:  # busy that long: its reader may have exited since
                _release_if_reader_gone(idle)
            if idle.free:
                slots.pop(i).close()
                self._bytes -= idle.capacity
        return slot

    def close(self) -> None:
        """Stop using the pool: unmap and close every free slot (receivers keep their own
        mappings). A busy slot stays open, unused, until the process exits: its message may not
        have been opened by its receiver yet. Idempotent."""
        with self._lock:
            for slots in self._slots.values():
                for slot in slots:
                    if slot.free:
                        slot.close()
            self._slots.clear()
            self._bytes = 0


_UNMAP_PAGES_FROM = 16 << 20
"""A receiver maps the pages of a slot at least this large only as they are read, and drops
them when it releases the slot (module docstring, "Receiver pages"); unit: bytes."""
_FAULT_AROUND = 64 << 10
"""Linux maps the pages of an aligned block this large around a read fault of a file page (its
default ``fault_around_bytes``): :func:`read_once` drops whole blocks, so the pages mapped
around a small array do not stay; unit: bytes."""


class _Mapping:
    """A receiver's mapping of one sender slot, kept while any lease uses it; pre-faulted
    below ``_UNMAP_PAGES_FROM`` data bytes, mapped on read above it (``on_read``)."""

    __slots__ = ("mm", "words", "address", "token", "capacity", "on_read", "leases", "sender_start", "inode")

    def __init__(self, path: str, sender_start: int | None) -> None:
        self.leases = 0  # live leases over this mapping (ShmReader.release refuses while any)
        self.sender_start = sender_start  # the sender's process_start when mapped
        try:
            target = os.readlink(path)
            if not target.startswith(f"/memfd:{_MEMFD_NAME}"):
                raise DecodeError(f"shared-memory handle {path} is {target!r}, not a replayrl pool slot")
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        except OSError as exc:
            raise DecodeError(f"shared-memory handle {path} cannot be opened: {exc.strerror}") from None
        try:
            info = os.fstat(fd)
            self.inode = info.st_ino  # the slot's memfd: the sender's fd may later name another
            if not stat.S_ISREG(info.st_mode) or info.st_size < _HEADER + _MIN_SLOT:
                raise DecodeError(f"shared-memory handle {path}: not a pool slot ({info.st_size} bytes)")
            self.on_read = info.st_size - _HEADER >= _UNMAP_PAGES_FROM
            self.mm = mmap.mmap(fd, info.st_size, flags=mmap.MAP_SHARED | (
                0 if self.on_read else getattr(mmap, "MAP_POPULATE", 0)))
        except OSError as exc:
            raise DecodeError(f"shared-memory handle {path} cannot be mapped: {exc.strerror}") from None
        finally:
            os.close(fd)
        whole = np.frombuffer(self.mm, dtype=np.uint8)
        self.words = whole[:8 * _WORDS].view("<u8")
        self.address = whole.ctypes.data
        self.token = int(self.words[_TOKEN])
        self.capacity = int(self.words[_CAPACITY])
        if self.capacity != info.st_size - _HEADER:
            raise DecodeError(f"shared-memory handle {path}: header says {self.capacity} data bytes, "
                              f"the slot has {info.st_size - _HEADER}")

    def advise(self, option: int, start: int, stop: int, align: int = mmap.PAGESIZE) -> None:
        """``madvise(option)`` over the ``align``-aligned blocks (data pages only) that hold data
        bytes ``[start, stop)``; a kernel without ``option`` or a mapping closed at exit leaves
        the pages as they are."""
        try:
            at = self.address + _HEADER  # blocks aligned in the address space, as the kernel's
            first = max((at + start) // align * align - self.address, _HEADER)
            end = min(-(-(at + stop) // align) * align - self.address, _HEADER + self.capacity)
            self.mm.madvise(option, first, end - first)
        except (ValueError, OSError, TypeError):  # TypeError: module globals already None at exit
            pass


def read_once(array: np.ndarray) -> "_ReadOnce":
    """Context manager around one read of ``array``: when it is a view of a received slot of at
    least 16 MiB, the pages the read mapped are dropped from this process on exit
    (``MADV_DONTNEED``; the contents stay the sender's, and a later read maps them again), so a
    reader that copies such a slot out array by array holds one array's pages at a time (module
    docstring, "Receiver pages"). Any other array: nothing happens. The pages dropped are those
    of the 64 KiB blocks that hold the array (the kernel maps a block around each read fault),
    so a neighbour may lose a few: it maps them again when read.

    Args:
        array: any numpy array (e.g. an entry of ``replayrl.transport.array_bundle.unpack_arrays``).
    """
    lease = array.base
    while isinstance(lease, np.ndarray):  # numpy collapses a view's base only down to the last array
        lease = lease.base
    if type(lease) is not _Lease or not lease.mapping.on_read or array.nbytes == 0:
        return _ReadOnce(None, 0, 0)
    start = array.__array_interface__["data"][0] - lease.mapping.address - _HEADER
    return _ReadOnce(lease.mapping, start, start + array.nbytes)


class _ReadOnce:
    """:func:`read_once`'s context manager (``mapping`` None: nothing to do)."""

    __slots__ = ("mapping", "start", "stop")

    def __init__(self, mapping: _Mapping | None, start: int, stop: int) -> None:
        self.mapping, self.start, self.stop = mapping, start, stop

    def __enter__(self) -> None:
        pass

    def __exit__(self, *exc_info: object) -> None:
        if self.mapping is not None:  # with the pages the kernel mapped around them
            self.mapping.advise(mmap.MADV_DONTNEED, self.start, self.stop, _FAULT_AROUND)


class _Lease:
    """The base object of every array over one received slot; dropping the last view of it
    releases the slot to its sender (module docstring, "Lifetime") and, for a large slot, its
    pages from this process ("Receiver pages")."""

    __slots__ = ("__array_interface__", "mapping", "generation", "__weakref__")

    def __del__(self, _released: int = _RELEASED,
                _dontneed: int = mmap.MADV_DONTNEED) -> None:  # bound now: also runs at exit
        mapping = self.mapping
        mapping.leases -= 1
        if mapping.on_read:  # before the release: the next message's pages are then never
            mapping.advise(_dontneed, 0, mapping.capacity)  # dropped under it
        mapping.words[_released] = self.generation


class ShmReader:
    """The receiving side: maps senders' slots (cached per slot) and leases arrays over them.

    One per process; used only for messages from ``ipc://`` peers (module docstring).
    """

    def __init__(self) -> None:
        self._maps: dict[tuple[int, int], _Mapping] = {}
        self._stamp = (0, 0)  # (pid, reader word) of this process; recomputed in a forked child

    def _reader_word(self) -> int:
        pid = os.getpid()
        if self._stamp[0] != pid:
            self._stamp = (pid, reader_word(pid, process_start(pid) or 0))
        return self._stamp[1]

    def array(self, handle: Any, typestr: str, shape: tuple[int, ...], nbytes: int,
              writable: bool) -> np.ndarray:
        """A numpy array of ``shape`` / ``typestr`` (numpy's ``'<f4'`` form) over the slot named by
        ``handle``, read-only unless ``writable``; the slot is released when it is dropped. The
        slot's reader word is set to this process (module docstring, "Lifetime").

        Raises:
            DecodeError: ``handle`` is not ``[pid, fd, token, generation]`` of ints, names no
                replayrl slot this process may open, a slot with another token or generation
                (stale or forged), or one smaller than ``nbytes``.
        """
        pid, fd, token, generation = _check_handle(handle)
        key = (pid, fd)
        mapping = self._maps.get(key)
        if mapping is None or mapping.token != token:
            self._forget_closed()
            try:
                sender_start = process_start(pid)
            except (OSError, ValueError, IndexError):
                sender_start = None
            mapping = _Mapping(f"/proc/{pid}/fd/{fd}", sender_start)
            self._maps[key] = mapping  # a replaced mapping lives on in its leases only
        if mapping.token != token:
            raise DecodeError(f"shared-memory handle of pid {pid} fd {fd}: token {token} does not "
                              "match the slot (stale or forged handle)")
        if int(mapping.words[_GENERATION]) != generation:
            raise DecodeError(f"shared-memory handle of pid {pid} fd {fd}: generation {generation}, "
                              f"the slot holds {int(mapping.words[_GENERATION])} (stale handle)")
        if nbytes > mapping.capacity:
            raise DecodeError(f"shared-memory array of {nbytes} bytes does not fit its slot of "
                              f"{mapping.capacity} bytes")
        mapping.words[_READER] = self._reader_word()  # before the lease can release the slot
        lease = _Lease()
        lease.mapping = mapping
        lease.generation = generation
        lease.__array_interface__ = {"data": (mapping.address + _HEADER, not writable), "shape": shape,
                                     "typestr": typestr, "version": 3}
        mapping.leases += 1
        return np.asarray(lease)

    def release(self, handle: Any) -> bool:
        """Give the slot named by ``handle`` back to its sender without reading it: its message is
        dropped undecoded (malformed, refused). Nothing is mapped for it: the header's words are
        read and written through ``/proc/<pid>/fd/<fd>`` unless this process maps the slot
        already. Leaves the slot alone when it holds another token or generation, is released
        already, or a view of it lives here.

        Returns:
            True when this call released the slot; False otherwise, including for a handle that
            is malformed or names nothing this process can open.
        """
        try:
            pid, fd, token, generation = _check_handle(handle)
        except DecodeError:
            return False
        mapping = self._maps.get((pid, fd))
        if mapping is not None and mapping.token == token:
            words = mapping.words
            if (mapping.leases or int(words[_GENERATION]) != generation
                    or int(words[_RELEASED]) == generation):
                return False
            words[_RELEASED] = generation
            return True
        path = f"/proc/{pid}/fd/{fd}"
        try:
            if not os.readlink(path).startswith(f"/memfd:{_MEMFD_NAME}"):
                return False
            slot_fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        except OSError:
            return False
        try:
            words = np.frombuffer(os.pread(slot_fd, 8 * _WORDS, 0), "<u8")
            if (len(words) != _WORDS or int(words[_TOKEN]) != token
                    or int(words[_GENERATION]) != generation or int(words[_RELEASED]) == generation):
                return False
            os.pwrite(slot_fd, int(generation).to_bytes(8, "little"), 8 * _RELEASED)
            return True
        except OSError:
            return False
        finally:
            os.close(slot_fd)

    def _forget_closed(self) -> None:
        """Drop cached mappings that no lease uses and whose slot its sender no longer has (the
        sender exited, or closed the slot): each keeps the slot's memory and a descriptor."""
        starts: dict[int, int | None] = {}
        for key in [k for k, m in self._maps.items() if not m.leases]:
            pid, fd = key
            mapping = self._maps[key]
            if pid not in starts:
                try:
                    starts[pid] = process_start(pid)
                except (OSError, ValueError, IndexError):
                    starts[pid] = mapping.sender_start  # unreadable: kept
            keep = starts[pid] is not None and starts[pid] == mapping.sender_start
            if keep:
                try:
                    keep = os.stat(f"/proc/{pid}/fd/{fd}").st_ino == mapping.inode
                except OSError:  # the sender closed that fd
                    keep = False
            if not keep:
                del self._maps[key]


def _check_handle(handle: Any) -> tuple[int, int, int, int]:
    """``handle`` as ``(pid, fd, token, generation)``.

    Raises:
        DecodeError: it is not a list of four ints with a plausible pid and fd.
    """
    if (type(handle) is not list or len(handle) != 4 or any(type(v) is not int for v in handle)
            or not 0 < handle[0] < _MAX_PID or not 0 <= handle[1] < _MAX_FD):
        raise DecodeError(f"shared-memory handle must be [pid, fd, token, generation] ints, "
                          f"got {str(handle)[:200]}")
    pid, fd, token, generation = handle
    return pid, fd, token, generation
