"""pc_rag/serve/admission.py: the bounded line of `pc-rag serve`, plain asyncio, no model.

Reference: the counts the rules imply (places handed on first come first served, a full line refused at once,
a wait that runs out refused, a cancelled wait leaving no place taken)."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("fastapi", reason="pc-rag serve needs the serve extra")

from pc_rag.serve.admission import Admission, QueueFull, QueueTimeout, TooLate  # noqa: E402


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


def test_a_first_token_limit_refuses_what_would_come_late_by_the_stated_rule():
    """requests ahead without a first token x the mean recent prefill + their p90 > the limit: refused at once."""
    async def main():
        adm = Admission(max_running=8, max_waiting=8, ttft_limit_s=2.5)
        await adm.acquire(None)  # nothing measured yet: taken
        assert adm.expected_first_token_s() is None and adm.before_first == 1
        adm.first_token(started=0.0, now=1.0)  # a prefill of 1 s
        assert adm.before_first == 0 and adm.expected_first_token_s() == 1.0
        await adm.acquire(None)  # 1 x 1 s
        await adm.acquire(None)  # 2 x 1 s
        assert adm.expected_first_token_s() == 3.0
        with pytest.raises(TooLate) as late:
            await adm.acquire(None)
        assert late.value.expected_s == 3.0 and isinstance(late.value, QueueFull)
        assert adm.rejected == 1 and adm.running == 3 and adm.before_first == 2
        adm.no_first_token()  # one failed before its first token: no longer ahead of anyone
        await adm.acquire(None)
        # service times as a single queue's: from the later of the start and the previous first token
        adm.first_token(started=5.0, now=6.0)  # 1.0
        adm.first_token(started=5.0, now=6.2)  # 0.2: it started before the previous first token
        assert adm.before_first == 0 and sorted(adm._prefill_s) == pytest.approx([0.2, 1.0, 1.0])
        assert adm.expected_first_token_s() == 1.0  # nobody ahead: the p90 of [0.2, 1.0, 1.0]
        await adm.acquire(None)
        await adm.acquire(None)
        assert adm.expected_first_token_s() == pytest.approx(2 * 2.2 / 3 + 1.0)  # two ahead at the mean, then own

    run(main())


def test_without_a_limit_nothing_is_refused_for_lateness():
    async def main():
        adm = Admission(max_running=4, max_waiting=0)
        await adm.acquire(None)
        adm.first_token(started=0.0, now=100.0)  # a 100 s prefill
        for _ in range(3):
            await adm.acquire(None)
        assert adm.running == 4 and adm.rejected == 0 and adm.expected_first_token_s() == 400.0

    run(main())
    with pytest.raises(ValueError, match="ttft_limit_s"):
        Admission(1, 1, ttft_limit_s=0)
