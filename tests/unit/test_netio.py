"""netio: the eager start of commands and the one-writelines-per-turn sender."""

import asyncio

import pytest

from openvsan.netio import WriteBatcher, start_eagerly, start_inline


def test_a_coroutine_that_does_not_suspend_needs_no_task():
    done = []

    async def quick():
        done.append(1)

    async def go():
        assert start_eagerly(quick()) is None
        assert done == [1]  # ran before start_eagerly returned

    asyncio.run(go())


def test_a_suspended_coroutine_goes_on_in_a_task_with_results_and_errors():
    async def go():
        fut = asyncio.get_running_loop().create_future()
        seen = []

        async def waits():
            seen.append("before")
            seen.append(await fut)
            await asyncio.sleep(0)
            try:
                await asyncio.get_running_loop().create_future()
            except asyncio.CancelledError:
                seen.append("cancelled")
                raise

        task = start_eagerly(waits())
        assert task is not None and seen == ["before"]
        fut.set_result("value")
        for _ in range(5):
            await asyncio.sleep(0)
        assert seen == ["before", "value"]
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert seen[-1] == "cancelled"

    asyncio.run(go())


def test_an_exception_before_suspension_reaches_the_caller():
    async def bad():
        raise ValueError("x")

    async def go():
        with pytest.raises(ValueError):
            start_eagerly(bad())

    asyncio.run(go())


class Transport:
    """What WriteBatcher sends on: each writelines or write, in order."""

    def __init__(self):
        self.calls = []

    def writelines(self, parts):
        self.calls.append(list(parts))

    def write(self, data):
        self.calls.append(["write", data])

    def is_closing(self):
        return False


def test_write_batcher_sends_one_writelines_per_turn():
    async def go():
        b = WriteBatcher()
        t = Transport()
        b.transport = t
        b.send([b"a", b"b"])
        b.send([b"c"])
        assert t.calls == []
        await asyncio.sleep(0)
        assert t.calls == [[b"a", b"b", b"c"]]
        b.send([b"hdr", b"data"])     # one small PDU: joined, one plain write
        await asyncio.sleep(0)
        assert t.calls[-1] == ["write", b"hdrdata"]
        b.send([b"h", bytes(20000)])  # a large payload is not copied: writelines
        await asyncio.sleep(0)
        assert t.calls[-1] == [b"h", bytes(20000)]
        del t.calls[1:]
        b.transport = None
        b.send([b"d"])
        await asyncio.sleep(0)
        assert len(t.calls) == 1  # nothing goes out once the connection is lost

    asyncio.run(go())


def test_a_large_batch_leaves_at_once_and_the_rest_at_the_end_of_the_turn():
    from openvsan.netio import FLUSH_PARTS

    async def go():
        b = WriteBatcher()
        t = b.transport = Transport()
        parts = [bytes([i]) for i in range(2 * FLUSH_PARTS + 5)]
        for p in parts:
            b.send([p])
        # the peer gets the first commands while the rest are being made, in order
        assert t.calls == [parts[:FLUSH_PARTS], parts[FLUSH_PARTS:2 * FLUSH_PARTS]]
        await asyncio.sleep(0)
        assert t.calls[2] == parts[2 * FLUSH_PARTS:] and len(t.calls) == 3    # 5 parts: writelines
        await asyncio.sleep(0)
        assert len(t.calls) == 3                  # nothing sent twice, no empty send
        # a connection answering one receive (holding) sends it whole when it is done
        t.calls.clear()
        b.holding = True
        for p in parts:
            b.send([p])
        assert t.calls == []
        b.holding = False
        b.flush()
        assert t.calls == [parts]

    asyncio.run(go())


def test_start_inline_runs_to_the_first_suspension_and_the_caller_drives_the_rest():
    async def go():
        loop = asyncio.get_running_loop()
        a, b = loop.create_future(), loop.create_future()
        seen = []

        async def command(tag, fut):
            seen.append(f"{tag} sent")
            value = await fut
            await asyncio.sleep(0)
            seen.append(f"{tag} {value}")
            return value

        tasks_before = len(asyncio.all_tasks())
        left_a, left_b = start_inline(command("a", a)), start_inline(command("b", b))
        assert seen == ["a sent", "b sent"]          # both sent before anything waits
        assert len(asyncio.all_tasks()) == tasks_before   # and no Task made for either
        b.set_result("B")                            # answers in any order
        a.set_result("A")
        assert await left_a == "A" and await left_b == "B"
        assert seen == ["a sent", "b sent", "a A", "b B"]

        async def at_once():
            return 7

        assert start_inline(at_once()) == 7           # never suspended: its result, nothing to await

        async def fails_later(fut):
            await fut
            raise OSError("peer gone")

        f = loop.create_future()
        left = start_inline(fails_later(f))
        f.set_result(None)
        with pytest.raises(OSError, match="peer gone"):
            await left

    asyncio.run(go())


def test_start_inline_left_unawaited_is_closed_with_its_cleanup():
    async def go():
        fut = asyncio.get_running_loop().create_future()
        cleaned = []

        async def holds_a_slot():
            try:
                await fut
            finally:
                cleaned.append("slot released")

        left = start_inline(holds_a_slot())
        left.close()                                  # what the mirror does when its own write is cancelled
        assert cleaned == ["slot released"]

    asyncio.run(go())
