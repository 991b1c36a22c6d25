"""Ending asyncio tasks without swallowing the caller's own cancellation.

``with suppress(BaseException): await task`` after ``task.cancel()`` also swallows the
``CancelledError`` meant for the task that waits: a server shutting down (uvicorn cancelling its
lifespan, a test's timeout) would then go on as if nothing had asked it to stop. Here the tasks'
own ends (cancelled, or failed: logged) are expected, and the caller's cancellation is raised:
the waiting uses :func:`asyncio.wait`, which never raises a task's exception and is interrupted
only by a cancellation of the waiting task itself.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable

__all__ = ["cancel_and_wait", "finish_or_cancel", "wait_ended"]

logger = logging.getLogger(__name__)


async def wait_ended(tasks: Iterable[asyncio.Future], timeout: float | None = None) -> bool:
    """Wait until ``tasks`` ended (at most ``timeout`` s; None: however long), without cancelling
    them; whether all did. A task that failed is logged with its traceback; a cancellation of
    the caller is raised (the tasks go on)."""
    tasks = list(tasks)
    pending = {t for t in tasks if not t.done()}
    if pending:
        _, pending = await asyncio.wait(pending, timeout=timeout)
    for task in tasks:
        if task.done() and not task.cancelled() and task.exception() is not None:
            exc = task.exception()
            logger.error("task %s failed: %s", _name(task), exc, exc_info=exc)
    return not pending


async def cancel_and_wait(*tasks: asyncio.Future | None) -> None:
    """Cancel ``tasks`` (None: skipped) and wait until each has ended; see :func:`wait_ended`."""
    live = [t for t in tasks if t is not None]
    for task in live:
        task.cancel()
    await wait_ended(live)


async def finish_or_cancel(task: asyncio.Future, timeout: float) -> bool:
    """Give ``task`` ``timeout`` s to end by itself, then cancel it and wait; whether it ended
    by itself."""
    if await wait_ended([task], timeout):
        return True
    await cancel_and_wait(task)
    return False


def _name(task: asyncio.Future) -> str:
    return task.get_name() if isinstance(task, asyncio.Task) else repr(task)
