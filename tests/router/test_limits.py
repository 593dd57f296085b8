"""router/limits.py in one event loop: the token bucket's arithmetic, the gate's FIFO order, and that no
way out of the queue (admitted, timed out, cancelled, cancelled as it was admitted) leaks a place."""

from __future__ import annotations

import asyncio

import pytest

from router.limits import Admission, Rejected, TokenBucket


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def test_token_bucket_refill_and_cap():
    clock = Clock()
    b = TokenBucket(2, 4.0, clock)
    assert b.try_take() and b.try_take() and not b.try_take()
    assert b.wait() == pytest.approx(0.25)
    clock.t += 0.125
    assert not b.try_take() and b.available() == pytest.approx(0.5)
    clock.t += 0.125
    assert b.try_take()
    clock.t += 100
    assert b.available() == 2.0  # never above its capacity


def test_fifo_order_and_no_leaks():
    async def main():
        gate = Admission(max_concurrent=1, queue_size=3, queue_timeout=5)
        order = []

        async def one(name):
            await gate.acquire()
            order.append(name)
            await asyncio.sleep(0.01)
            gate.release()

        await gate.acquire()  # hold the only place
        tasks = [asyncio.create_task(one(n)) for n in "abc"]
        await asyncio.sleep(0.01)
        assert gate.queued == 3
        with pytest.raises(Rejected) as e:
            await gate.acquire()
        assert e.value.status == 429 and e.value.headers == {"Retry-After": "1"}
        tasks[1].cancel()  # "b" leaves the queue
        await asyncio.sleep(0)
        assert gate.queued == 2
        gate.release()
        await asyncio.gather(tasks[0], tasks[2])
        assert order == ["a", "c"]
        assert (gate.in_flight, gate.queued, dict(gate.rejected)) == (0, 0, {"queue_full": 1})

    asyncio.run(main())


def test_timeout_and_cancel_at_admission_release_the_place():
    async def main():
        gate = Admission(max_concurrent=1, queue_size=2, queue_timeout=0.05)
        await gate.acquire()
        with pytest.raises(Rejected) as e:
            await gate.acquire()
        assert e.value.status == 408 and gate.queued == 0
        # a waiter admitted and cancelled before it ran gives its place back
        waiter = asyncio.create_task(gate.acquire())
        await asyncio.sleep(0)
        gate.release()  # admits the waiter (in_flight stays 1)
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert (gate.in_flight, gate.queued) == (0, 0)

    asyncio.run(main())


def test_rate_limit_queues_then_admits():
    async def main():
        gate = Admission(max_concurrent=-1, queue_size=1, queue_timeout=5, rate=20.0)  # 20 tokens, 20/s
        for _ in range(20):
            await gate.acquire()
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        await gate.acquire()  # waits ~1/20 s for a token though no concurrency limit is set
        assert loop.time() - t0 > 0.02
        assert gate.in_flight == 21

    asyncio.run(main())


def test_disabled_counts_in_flight_only():
    async def main():
        gate = Admission()
        assert not gate.enabled
        for _ in range(1000):
            await gate.acquire()
        assert gate.in_flight == 1000 and gate.queued == 0

    asyncio.run(main())


@pytest.mark.parametrize("flags, named", [
    (["--enable-igw"], "--enable-igw"),
    (["--tokenizer-path", "/tmp"], "--tokenizer-path"),
    (["--queue-size", "5"], "--queue-size"),
])
def test_flags_that_would_do_nothing_are_refused(flags, named, capsys):
    from router.cli import main

    with pytest.raises(SystemExit) as e:
        main(["--pd-disaggregation", "--prefill", "http://127.0.0.1:1", "none", "--decode", "http://127.0.0.1:2",
              *flags])
    assert e.value.code == 2 and named in capsys.readouterr().err
