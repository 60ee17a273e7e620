"""The admission chain (engine/admission.py): its order, how a stage continues, answers, refuses
or waits, that observers see both outcomes, and the stages whose rule is theirs alone (the
deadline, the tenant's quota for a step or a shadow)."""

from __future__ import annotations

import asyncio
import time
from typing import Any, cast

import numpy as np
import pytest

from inference_requests import request_of
from servewell.engine.admission import (
    AdmissionChain,
    Admitting,
    FitsDeadline,
    Outcome,
    TenantQuota,
)
from servewell.engine.model_entry import ModelEntry
from servewell.engine.protocol import RequestResult
from servewell.engine.request import InferenceRequest
from servewell.engine.tenants import Tenants
from servewell.errors import DeadlineExceeded, NotFound, OverQuota, ServeError

ANSWER = RequestResult({"y": np.zeros((1, 1), np.float32)}, 0.0, 0.0, 1)


def answered(result: RequestResult = ANSWER) -> Outcome:
    future: Outcome = asyncio.get_running_loop().create_future()
    future.set_result(result)
    return future


class Recorder:
    """A stage that records that it ran, then continues."""

    def __init__(self, name: str, seen: list[str]) -> None:
        self.name, self.seen = name, seen

    def __call__(self, chain: AdmissionChain, call: Admitting, at: int) -> Outcome:
        self.seen.append(self.name)
        return chain.proceed(call, at)


class Answer:
    """The last stage: answers at once."""

    def __init__(self, seen: list[str]) -> None:
        self.seen = seen

    def __call__(self, chain: AdmissionChain, call: Admitting, at: int) -> Outcome:
        self.seen.append("answer")
        return answered()


class Refuse:
    def __call__(self, chain: AdmissionChain, call: Admitting, at: int) -> Outcome:
        raise NotFound("no such model")


class WaitFor:
    """Waits for `event`, then continues (a cold load's shape)."""

    def __init__(self, event: asyncio.Event) -> None:
        self.event = event

    def __call__(self, chain: AdmissionChain, call: Admitting, at: int) -> Outcome:
        async def later() -> RequestResult:
            await self.event.wait()
            return await chain.proceed(call, at)
        return asyncio.ensure_future(later())


class Observed:
    def __init__(self) -> None:
        self.admitted: list[InferenceRequest] = []
        self.refused: list[str] = []

    def admitted_(self, call: Admitting, outcome: Outcome) -> None:
        self.admitted.append(call.request)

    def refused_(self, call: Admitting, error: ServeError) -> None:
        self.refused.append(error.code)


class Observer:
    def __init__(self, record: Observed) -> None:
        self.record = record

    def admitted(self, call: Admitting, outcome: Outcome) -> None:
        self.record.admitted_(call, outcome)

    def refused(self, call: Admitting, error: ServeError) -> None:
        self.record.refused_(call, error)


def test_stages_run_in_order_and_a_resident_model_is_answered_before_submit_returns() -> None:
    async def main() -> None:
        seen: list[str] = []
        record = Observed()
        chain = AdmissionChain((Recorder("a", seen), Recorder("b", seen), Answer(seen)), (Observer(record),))
        outcome = chain.submit(request_of({}))
        assert outcome.done() and seen == ["a", "b", "answer"]  # synchronous: no task, no loop turn
        assert [r.id for r in record.admitted] == ["r"] and record.refused == []
        assert chain.names == ("Recorder", "Recorder", "Answer")
    asyncio.run(main())


def test_a_refusal_is_raised_at_once_and_seen_by_every_observer_and_later_stages_never_run() -> None:
    async def main() -> None:
        seen: list[str] = []
        record = Observed()
        chain = AdmissionChain((Recorder("a", seen), Refuse(), Answer(seen)), (Observer(record), Observer(record)))
        with pytest.raises(NotFound):
            chain.submit(request_of({}))
        assert seen == ["a"] and record.refused == ["not_found", "not_found"] and record.admitted == []
    asyncio.run(main())


def test_a_waiting_stage_proceeds_once_what_it_waits_for_is_done() -> None:
    async def main() -> None:
        seen: list[str] = []
        loaded = asyncio.Event()
        chain = AdmissionChain((WaitFor(loaded), Recorder("after", seen), Answer(seen)))
        outcome = chain.submit(request_of({}))
        await asyncio.sleep(0)
        assert not outcome.done() and seen == []
        loaded.set()
        assert await outcome is ANSWER and seen == ["after", "answer"]
    asyncio.run(main())


# --- FitsDeadline ---------------------------------------------------------------------------------


class Predicting:
    """An entry whose model's batch of any size takes `batch_s`."""

    def __init__(self, batch_s: float) -> None:
        self.scheduler = self
        self.limits = self
        self.batch_s = batch_s

    def predicted_compute_s(self, rows: int) -> float:
        return self.batch_s


def fits(deadline_in_s: float, batch_s: float, tenant: str = "acme") -> Outcome:
    seen: list[str] = []
    chain = AdmissionChain((FitsDeadline(), Answer(seen)))
    now = time.monotonic()
    call = Admitting(request_of({}, deadline_at=now + deadline_in_s, arrived_at=now - 0.1, tenant=tenant), False)
    call.entry = cast(ModelEntry, Predicting(batch_s))
    return chain.proceed(call, -1)


def test_a_deadline_passed_before_queueing_is_refused_naming_its_tenant() -> None:
    async def main() -> None:
        with pytest.raises(DeadlineExceeded, match="passed before it was queued") as refused:
            fits(-0.01, 0.0)
        assert refused.value.tenant == "acme"
    asyncio.run(main())


def test_a_request_that_cannot_finish_before_its_deadline_is_refused_before_compute() -> None:
    async def main() -> None:
        with pytest.raises(DeadlineExceeded, match="a batch of model 'm' takes about 200.0 ms: not started"):
            fits(0.05, 0.2)
        assert (await fits(0.5, 0.2)) is ANSWER
    asyncio.run(main())


# --- TenantQuota ---------------------------------------------------------------------------------


class Ring:
    """The keys in force, as Tenants reads them: tenant 'acme' may have one request at a time."""

    keys = [type("Key", (), {"id": "k", "tenant_id": "acme", "weight": None, "rate_per_s": None,
                             "max_concurrent": 1, "max_queued": None})()]


def test_a_tenants_quota_counts_the_request_a_client_sent_never_its_steps_or_shadow_copies() -> None:
    async def main() -> None:
        tenants = Tenants(lambda: cast(Any, Ring()))
        seen: list[str] = []
        pending: Outcome = asyncio.get_running_loop().create_future()

        class Hold:
            def __call__(self, chain: AdmissionChain, call: Admitting, at: int) -> Outcome:
                seen.append(call.request.id)
                return pending

        chain = AdmissionChain((TenantQuota(tenants), Hold()))
        parent = request_of({}, tenant="acme", request_id="p")
        first = chain.submit(parent)
        with pytest.raises(OverQuota):
            chain.submit(request_of({}, tenant="acme", request_id="second"))
        step = parent.step("other", {}, None, 0)
        shadow = parent.shadow_copy("2", 1, time.monotonic() + 10)
        chain.submit(step)
        chain.submit(shadow)
        assert seen == ["p", "p", "p"] and not step.counted and not shadow.counted
        assert step.parent == "p" and step.tenant == "acme" and step.deadline_at == parent.deadline_at
        assert first is pending
    asyncio.run(main())
