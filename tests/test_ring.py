"""The low-level shared-memory pieces: rings, segments, doorbells, /dev/shm housekeeping."""
import os
import random
import signal
import struct
import subprocess
import sys
import time
import zlib
from collections import deque

import multiprocess
import pytest
from hypothesis import given, settings, strategies as st

from conftest import shmrl_files
from shmrl.transport.doorbell import Doorbell, PeerGone
from shmrl.transport.ring import (Ring, RingCorrupt, Segment, ShmSpaceError, check_shm_space,
                                  fifo_path, segment_name, shm_free_bytes, sweep_stale)
from shmrl.transport.slot import ClientSlot

fork = multiprocess.get_context("fork")  # fast children; the owner's FIFO ends are closed in them
_names = iter(range(10 ** 9))


pytestmark = pytest.mark.usefixtures("no_shm_leftovers")


def new_name() -> str:
    return segment_name("shmrl", os.getpid(), f"t{next(_names)}")


@pytest.fixture
def segment():
    made = []

    def make(size):
        seg = Segment.create(new_name(), size)
        made.append(seg)
        return seg
    yield make
    for seg in made:
        seg.close()


def padded(n: int) -> int:
    return (16 + n + 7) & ~7


def situation(ring: Ring, n: int) -> str:
    """How a frame of n bytes lands at the ring's current write position."""
    room = ring.capacity - ring.write_pos % ring.capacity
    size = padded(n)
    if size < room:
        return "fits"
    if size == room:
        return "exact fit"
    return "implicit wrap" if room < 16 else "wrap marker of 16" if room == 16 else "wrap marker"


# ---------------------------------------------------------------- round trips

def test_round_trip_covers_every_wrap_situation():
    ring = Ring(memoryview(bytearray(Ring.nbytes(1024))), 0, 1024)
    rnd, model, seen = random.Random(7), deque(), set()
    for i in range(4000):
        if rnd.random() < 0.55:
            room = ring.capacity - ring.write_pos % ring.capacity
            # Aim at the boundaries now and then: an exact fit, or just too big for the room.
            n = rnd.choice([rnd.randrange(0, ring.max_payload + 1), room - 16, room - 8, room - 16 + 1])
            n = min(max(n, 0), ring.max_payload)
            how = situation(ring, n)
            frame = rnd.randbytes(n)
            if ring.try_write([frame[:n // 3], memoryview(frame)[n // 3:]]):
                model.append(frame)
                seen.add(how)
        else:
            got = ring.read(strict=True)
            assert got == (model.popleft() if model else None), i
    while model:
        assert ring.read(strict=True) == model.popleft()
    assert ring.read() is None and not ring.pending()
    assert seen == {"fits", "exact fit", "implicit wrap", "wrap marker of 16", "wrap marker"}


@settings(max_examples=150, deadline=None)
@given(st.lists(st.one_of(st.integers(0, 240), st.just(-1)), max_size=80))
def test_round_trip_any_sequence(ops):
    """Any interleaving of writes (size) and reads (-1) behaves like a FIFO queue."""
    ring = Ring(memoryview(bytearray(Ring.nbytes(512))), 0, 512)
    model = deque()
    for k, op in enumerate(ops):
        if op < 0:
            assert ring.read(strict=True) == (model.popleft() if model else None)
        else:
            frame = bytes([k % 256]) * op
            if ring.try_write([frame]):
                model.append(frame)
            else:  # refused only when it really does not fit
                used = ring.write_pos - ring.read_pos
                room = ring.capacity - ring.write_pos % ring.capacity
                need = padded(op) + (room if padded(op) > room else 0)
                assert used + need > ring.capacity
    while model:
        assert ring.read(strict=True) == model.popleft()


def frame_for(seq: int, max_payload: int) -> bytes:
    rnd = random.Random(seq)
    return seq.to_bytes(8, "little") + rnd.randbytes(rnd.randrange(0, max_payload - 8))


def write_frames(name: str, count: int) -> None:
    seg = Segment.attach(name)
    ring = Ring(seg.buf, 0, len(seg.buf) - Ring.HEADER_BYTES)
    for seq in range(count):
        ring.write([frame_for(seq, ring.max_payload)], timeout=10)


def test_producer_in_another_process(segment, children):
    seg = segment(Ring.nbytes(4096))
    ring = Ring(seg.buf, 0, 4096)
    count = 3000
    p = fork.Process(target=write_frames, args=(seg.name, count))
    p.start()
    children.append(p)
    deadline = time.monotonic() + 10
    for seq in range(count):
        while (got := ring.read(strict=True)) is None:
            assert time.monotonic() < deadline, f"stuck at frame {seq}"
            time.sleep(0.0001)
        assert got == frame_for(seq, ring.max_payload)
    p.join(5)
    assert p.exitcode == 0 and ring.read() is None
    ring.close()


# ---------------------------------------------------------------- full, too big

def test_full_ring_refuses_then_makes_room():
    ring = Ring(memoryview(bytearray(Ring.nbytes(256))), 0, 256)
    frame = b"x" * 100  # 120 bytes a record: two fit, the third needs the 16 bytes at the end too
    assert ring.try_write([frame]) and ring.try_write([frame])
    assert not ring.try_write([frame])
    t0 = time.monotonic()
    with pytest.raises(TimeoutError):
        ring.write([frame], timeout=0.1)
    assert 0.1 <= time.monotonic() - t0 < 1.0
    assert ring.read() == frame
    assert ring.try_write([frame])
    assert [ring.read(), ring.read(), ring.read()] == [frame, frame, None]


def test_frame_bigger_than_the_ring_is_refused():
    ring = Ring(memoryview(bytearray(Ring.nbytes(1024))), 0, 1024)
    assert ring.try_write([bytes(ring.max_payload)])  # the largest frame fits, even after a wrap
    with pytest.raises(ValueError, match=rf"{ring.max_payload + 1} bytes.*{ring.max_payload} bytes"):
        ring.try_write([bytes(ring.max_payload + 1)])
    with pytest.raises(ValueError, match="larger than"):
        ring.write([bytes(5000)], timeout=0.1)


# ---------------------------------------------------------------- a writer killed mid-frame

def self_checked_frame(seq: int, rnd: random.Random, max_payload: int) -> bytes:
    body = struct.pack("<Q", seq) + rnd.randbytes(rnd.randrange(0, max_payload - 12))
    return body + struct.pack("<I", zlib.crc32(body))


def check_frame(frame: bytes) -> int:
    body, crc = frame[:-4], struct.unpack("<I", frame[-4:])[0]
    assert zlib.crc32(body) == crc, "torn frame"
    return struct.unpack("<Q", body[:8])[0]


def write_until_killed(name: str) -> None:
    seg = Segment.attach(name)
    ring = Ring(seg.buf, 0, len(seg.buf) - Ring.HEADER_BYTES)
    rnd, seq = random.Random(os.getpid()), 0
    while True:
        frame = self_checked_frame(seq, rnd, ring.max_payload)
        ring.write([frame[:7], frame[7:]], timeout=60)  # several parts: a longer window to die in
        seq += 1


def test_writer_killed_at_random_moments_leaves_only_whole_frames(segment, children):
    seg = segment(Ring.nbytes(1 << 16))
    ring = Ring(seg.buf, 0, 1 << 16)
    rnd, total = random.Random(3), 0
    for _ in range(6):
        p = fork.Process(target=write_until_killed, args=(seg.name,))
        p.start()
        children.append(p)
        expected = 0
        deadline = time.monotonic() + rnd.uniform(0.02, 0.15)
        while time.monotonic() < deadline:
            got = ring.read(strict=True)
            if got is not None:
                assert check_frame(got) == expected
                expected += 1
        os.kill(p.pid, signal.SIGKILL)
        p.join(5)
        while (got := ring.read(strict=True)) is not None:
            assert check_frame(got) == expected
            expected += 1
        assert not ring.pending()
        total += expected
        # The ring stays usable: the next writer overwrites whatever the dead one left.
        assert ring.try_write([b"after"]) and ring.read(strict=True) == b"after"
    assert total > 100
    ring.close()


# ---------------------------------------------------------------- corruption

def test_corrupt_or_stale_records_raise(segment):
    seg = segment(Ring.nbytes(1024))
    ring = Ring(seg.buf, 0, 1024)
    data = Ring.HEADER_BYTES  # where the first record starts in the segment
    poke = Segment.attach(seg.name)  # another mapping, as a misbehaving process would have

    ring.try_write([b"hello world"])
    poke.buf[data + 16] ^= 0xFF  # a payload byte
    assert ring.read() is None and ring.read() is None  # maybe not visible yet...
    with pytest.raises(RingCorrupt, match="crc"):
        ring.read()  # ...but the third look is not a visibility delay
    with pytest.raises(RingCorrupt, match="crc"):
        ring.read(strict=True)

    ring.reset()
    for _ in range(5):  # lap the ring once, then make a record claim its earlier lap
        ring.try_write([bytes(200)])
        ring.read(strict=True)
    ring.try_write([b"new"])
    off = data + ring.read_pos % 1024
    struct.pack_into("<Q", poke.buf, off, ring.read_pos - 1024)
    with pytest.raises(RingCorrupt, match="stale"):
        ring.read(strict=True)

    ring.reset()
    ring.try_write([b"abc"])
    struct.pack_into("<I", poke.buf, data + 8, 5000)  # a length beyond the ring
    with pytest.raises(RingCorrupt, match="length"):
        ring.read(strict=True)

    ring.reset()
    struct.pack_into("<Q", poke.buf, 0, 10 ** 9)  # a write position far ahead of the reader
    with pytest.raises(RingCorrupt, match="out of range"):
        ring.read()
    with pytest.raises(RingCorrupt, match="out of range"):
        ring.try_write([b"x"])
    ring.reset()
    assert ring.read() is None  # zeroed memory is never a valid record
    struct.pack_into("<Q", poke.buf, 0, 16)
    with pytest.raises(RingCorrupt):
        ring.read(strict=True)
    poke.close()
    ring.close()


# ---------------------------------------------------------------- files in /dev/shm

def test_slot_and_doorbell_files_are_unlinked_on_close():
    name = new_name()
    slot = ClientSlot.create(name, 4096, 1024)
    bell = Doorbell.create(fifo_path(name))
    client_slot = ClientSlot.attach(name)
    client_bell = Doorbell.open(fifo_path(name), "r")
    assert {name, name + ".fifo"} <= shmrl_files()
    client_slot.client_pid = 1234
    assert slot.client_pid == 1234  # both see the same memory
    slot.close()  # the owner goes while a client is attached
    bell.close()
    bell.close()  # idempotent
    assert not {name, name + ".fifo"} & shmrl_files()
    client_slot.requests.try_write([b"still mapped"])  # the client's mapping lives on
    assert client_slot.requests.read() == b"still mapped"
    client_slot.close()
    client_bell.close()
    with pytest.raises(FileNotFoundError, match="learner running"):
        ClientSlot.attach(name)


def test_sweep_stale_removes_only_files_of_dead_pids():
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        made = []
        for pid in (dead.pid, live.pid):
            name = segment_name("shmrl", pid, "c0")
            seg = Segment.create(name, 4096)
            seg.owner = False  # pretend a foreign owner: closing must not unlink it
            seg.close()
            bell = Doorbell.create(fifo_path(name))
            bell.owner = False
            bell.close()
            made.append(name)
        removed = sweep_stale("shmrl")
        dead_files = {made[0], made[0] + ".fifo"}
        assert dead_files <= set(removed)
        assert all(int(r.split("_")[1]) != live.pid for r in removed)
        assert {made[1], made[1] + ".fifo"} <= shmrl_files()
        assert not dead_files & shmrl_files()
    finally:
        live.kill()
        live.wait()
    assert {made[1], made[1] + ".fifo"} <= set(sweep_stale("shmrl"))  # dead now


def test_check_shm_space_says_what_is_needed_and_how_to_get_it():
    assert shm_free_bytes() > 0
    check_shm_space(1 << 20, free_bytes=2 << 20)
    with pytest.raises(ShmSpaceError) as e:
        check_shm_space(100 << 20, free_bytes=64 << 20)
    msg = str(e.value)
    assert "100.0 MiB" in msg and "64.0 MiB" in msg and "--shm-size" in msg and "remount" in msg


# ---------------------------------------------------------------- doorbells

@pytest.fixture
def bell():
    b = Doorbell.create(fifo_path(new_name()))
    yield b
    b.close()


def test_doorbell_wait_times_out_without_burning_cpu(bell):
    cpu, wall = time.process_time(), time.monotonic()
    assert bell.wait(0.3) is False
    assert time.monotonic() - wall >= 0.29
    assert time.process_time() - cpu < 0.05


def ring_later(path: str, delay: float) -> None:
    b = Doorbell.open(path, "w")
    time.sleep(delay)
    for _ in range(3):
        b.ring()


def test_doorbell_rung_from_another_process_wakes_the_waiter(bell, children):
    p = fork.Process(target=ring_later, args=(bell.path, 0.1))
    p.start()
    children.append(p)
    assert bell.wait(5.0) is True
    p.join(5)
    for _ in range(3):
        bell.ring()
    assert bell.wait(0.0) is True
    assert bell.wait(0.0) is False  # one wait drains every byte


def test_doorbell_reader_sees_the_owner_go(bell):
    reader = Doorbell.open(bell.path, "r")
    writer = Doorbell.open(bell.path, "w")
    bell.ring()
    assert reader.wait(1.0) and not reader.peer_gone()
    bell.close()  # the owner exits: the client's write end keeps nothing alive for its reader
    writer.close()
    assert reader.peer_gone()
    with pytest.raises(PeerGone):
        reader.wait(1.0)
    reader.close()


def test_doorbell_writer_sees_the_owner_go(bell):
    writer = Doorbell.open(bell.path, "w")
    bell.close()
    with pytest.raises(PeerGone):
        writer.ring()
    writer.close()
