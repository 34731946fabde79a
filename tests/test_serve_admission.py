"""pc_rag/serve/admission.py: the bounded line of `pc-rag serve`, plain asyncio, no model.

Reference: the counts the rules imply (places handed on first come first served, a full line refused at once,
a wait that runs out refused, a cancelled wait leaving no place taken)."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("fastapi", reason="pc-rag serve needs the serve extra")

from pc_rag.serve.admission import Admission, QueueFull, QueueTimeout  # noqa: E402


def run(coro):
    return asyncio.run(coro)


def test_places_pass_on_in_arrival_order():
    async def main():
        adm = Admission(max_running=2, max_waiting=5)
        await adm.acquire(None)
        await adm.acquire(None)
        order = []

        async def wait(i):
            await adm.acquire(None)
            order.append(i)

        tasks = [asyncio.create_task(wait(i)) for i in range(3)]
        await asyncio.sleep(0.01)
        assert adm.running == 2 and adm.waiting == 3
        for _ in range(3):
            adm.release(0.5)
            await asyncio.sleep(0.01)
        await asyncio.gather(*tasks)
        assert order == [0, 1, 2] and adm.running == 2 and adm.waiting == 0
        adm.release()
        adm.release()
        assert adm.running == 0 and adm.served == 3

    run(main())


def test_a_full_line_is_refused_at_once_and_a_long_wait_runs_out():
    async def main():
        adm = Admission(max_running=1, max_waiting=1)
        await adm.acquire(None)
        waiting = asyncio.create_task(adm.acquire(0.05))
        await asyncio.sleep(0.01)
        with pytest.raises(QueueFull):
            await adm.acquire(10)
        with pytest.raises(QueueTimeout):
            await waiting
        assert adm.rejected == 2 and adm.running == 1 and adm.waiting == 0
        assert adm.retry_after_s() >= 1
        adm.release()
        assert adm.running == 0

    run(main())


def test_a_cancelled_wait_takes_no_place():
    async def main():
        adm = Admission(max_running=1, max_waiting=4)
        await adm.acquire(None)
        gone = asyncio.create_task(adm.acquire(None))  # a client that disconnects while in line
        stays = asyncio.create_task(adm.acquire(None))
        await asyncio.sleep(0.01)
        gone.cancel()
        await asyncio.sleep(0.01)
        adm.release()  # the place goes to the one still waiting, not to the cancelled wait
        await asyncio.wait_for(stays, 1)
        assert adm.running == 1 and adm.waiting == 0
        adm.release()
        assert adm.running == 0

    run(main())


def test_bad_bounds():
    with pytest.raises(ValueError, match="max_running"):
        Admission(0, 1)
