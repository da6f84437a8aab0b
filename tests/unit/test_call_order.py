"""A shard runs the router's numbered calls in the router's order, whatever order they arrive in."""

from __future__ import annotations

import asyncio

import pytest

from gaudi_runtime.shard.call_order import CallOrder


async def call(order: CallOrder, seq: int, ran: list[int], fail: bool = False) -> None:
    async with order.turn(seq):
        ran.append(seq)
        if fail:
            raise ValueError("bad batch")


def test_calls_run_in_their_numbers_order_not_their_arrival_order():
    async def run():
        order, ran = CallOrder(), []
        await asyncio.gather(*(call(order, s, ran) for s in (3, 1, 4, 2)))
        return ran

    assert asyncio.run(run()) == [1, 2, 3, 4]


def test_a_failed_call_still_lets_the_next_one_run():
    async def run():
        order, ran = CallOrder(), []
        results = await asyncio.gather(call(order, 2, ran), call(order, 1, ran, fail=True), return_exceptions=True)
        return ran, results

    ran, results = asyncio.run(run())
    assert ran == [1, 2]
    assert results[0] is None and isinstance(results[1], ValueError)


def test_unnumbered_calls_run_at_once():
    async def run():
        order, ran = CallOrder(), []
        waiting = asyncio.create_task(call(order, 2, ran))  # waits for a call 1 that has not come
        await call(order, 0, ran)
        assert ran == [0] and not waiting.done()
        await call(order, 1, ran)
        await asyncio.wait_for(waiting, 5)
        return ran

    assert asyncio.run(run()) == [0, 1, 2]


@pytest.mark.parametrize("late", [1, 5])
def test_a_number_already_passed_runs_at_once(late):
    async def run():
        order, ran = CallOrder(), []
        for s in range(1, 6):
            await call(order, s, ran)
        await asyncio.wait_for(call(order, late, ran), 5)  # e.g. a second client's count behind ours
        return ran

    assert asyncio.run(run())[-1] == late
