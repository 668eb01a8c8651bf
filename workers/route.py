"""Where each finished item goes next: the reply stream, the next step's stream, a join.

Pure decisions from the pipeline graph; :mod:`workers.publish` turns them into one
atomic script call with the batch's ack. Each request's effects are grouped under a "done" marker
(request id + step): publishing skips a group whose marker exists, so a step that ran
twice (a slow worker and the one that reclaimed its entry) has its effect once.

A branch of a join that fails answers the request only if no other branch has: its answer
is guarded as well by the join step's own marker, which every branch of that request
shares (and which the join, had it fired, would have set): the first failure answers and
sets it; a later one is counted at its stage and answers nothing.
"""

from __future__ import annotations

import logging
from typing import Any

import orjson

from pipelines.envelope import Reply, Request, Sender, dumps, wire_problem
from pipelines.errors import (
    RETRY_AFTER_MAX_S,
    Cancelled,
    ConveyorError,
    DeadlineExceeded,
    InvalidInput,
    http_status,
)
from pipelines.graph import End, Pipeline, Step
from pipelines.keys import Keys
from pipelines.model import Result
from pipelines.outcomes import Outcome
from pipelines.registry import Registry
from pipelines.settings import MAX_DEADLINE_S
from workers.contract import checked
from workers.settings import MAX_RESULT_BYTES
from workers.values import Batch, Effects, JoinArrival, Outbox

logger = logging.getLogger(__name__)

JOIN_GRACE_S = 60
"""Join state and "done" markers outlive the request's deadline by this much, then expire."""

LATE_S = JOIN_GRACE_S / 2
"""A result this long past its deadline is dropped unpublished: the marker that would stop
a second publish of it (another worker already answered) may have expired. Half the grace
leaves room for the truncated TTL and for clocks."""


def client_message(exc: BaseException) -> str:
    """What a client is told about a failure: the error's kind and first line, no internals."""
    if isinstance(exc, ConveyorError):
        return str(exc)
    first = str(exc).splitlines()[0][:200] if str(exc) else ""
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__


class Router:
    """Turns each item's outcome into outbox entries.

    Args:
        registry: the pipelines this worker knows.
        keys: key names.
        stage: the stage this worker serves (named in replies).
        max_result_bytes: the most one request's step may write, encoded (its reply or
            job result, its hand-overs, its join arrivals); a step whose output is larger
            fails alone (422, naming the bound), nothing of it written.
    """

    def __init__(
        self,
        registry: Registry,
        keys: Keys,
        stage: str,
        max_result_bytes: int = MAX_RESULT_BYTES,
    ) -> None:
        self.registry = registry
        self.keys = keys
        self.stage = stage
        self.max_result_bytes = max_result_bytes

    def locate(self, req: Request) -> tuple[Pipeline, Step]:
        """The pipeline and step an entry is for.

        Raises:
            UnknownStage: this worker was not given that pipeline or step.
        """
        pipeline = self.registry.pipeline(req.pipeline)
        return pipeline, pipeline.step(req.step)

    def fail(
        self,
        out: Outbox,
        req: Request,
        outcome: Outcome,
        message: str,
        *,
        status: int,
        retry_after: float | None = None,
        now: float,
    ) -> None:
        """End the request with an error; a branch also marks its join as failed."""
        effects = self._effects(out, req, now)
        # Finite (an infinite one would travel as null: no Retry-After at all).
        bounded = None if retry_after is None else min(retry_after, RETRY_AFTER_MAX_S)
        reply = Reply(
            id=req.id,
            stage=self.stage,
            outcome=outcome,
            error=message,
            status=status,
            retry_after=bounded,
            trace_id=req.trace_id,
        )
        effects.replies.append((req.reply_to, reply))
        try:
            pipeline, step = self.locate(req)
        except ConveyorError:
            return
        # A branch (any step of one) leads to its join alone (checked when built).
        joined = pipeline.branch_end(step.name) if step.then else None
        if joined is not None:
            name = joined[0].name
            effects.failed_joins.append((self.keys.join(req.id, name), self._ttl(req, now)))
            effects.answer_marker = self.keys.done(req.id, name)

    def cancel(self, out: Outbox, req: Request, now: float) -> None:
        """End ``req`` cancelled before its step ran: as any failure, its job record says
        so and a branch fails its join, so the join never fires."""
        message = "cancelled before the step ran"
        self.fail(out, req, Outcome.CANCELLED, message, status=Cancelled.status, now=now)

    def fail_unreadable(self, out: Outbox, who: Sender, message: str) -> bool:
        """Tell the caller of an entry that did not decode (version skew, corruption)
        that it failed, when the entry names a reply address of this namespace; whether
        it did."""
        if not self.keys.is_reply_target(who.reply_to):
            return False
        marker = self.keys.done(who.id, who.step)
        effects = out.effects.setdefault(marker, Effects(marker_ttl_s=JOIN_GRACE_S))
        reply = Reply(
            id=who.id,
            stage=self.stage,
            outcome=Outcome.ERROR,
            error=message,
            status=500,
            trace_id=who.trace_id,
        )
        effects.replies.append((who.reply_to, reply))
        return True

    def late(self, out: Outbox, req: Request, now: float) -> bool:
        """Whether ``req``'s result comes too late to deliver: past its deadline the caller
        was told 504 (a job reads "expired"), so it ends expired, never ``ok``; well past
        it, nothing is published at all (see :data:`LATE_S`)."""
        if now <= req.deadline:
            return False
        if now <= req.deadline + LATE_S:
            self.fail(
                out, req, Outcome.EXPIRED, "deadline passed while the step ran", status=504, now=now
            )
        return True

    def route_all(self, batch: Batch, now: float) -> None:
        """Route each of ``batch``'s live requests with its result (:meth:`route`), into
        its outbox, the model having finished at ``now``."""
        for (req, _), result in zip(batch.live, batch.results, strict=True):
            self.route(batch.out, req, result, now)

    def route(self, out: Outbox, req: Request, result: Result | BaseException, now: float) -> None:
        """End ``req``'s step with the model's ``result``: expired if it came late, its
        error if it failed or cannot be sent (:func:`workers.contract.checked`), else on."""
        if self.late(out, req, now):
            return
        result = checked(result)
        if isinstance(result, DeadlineExceeded):  # the model stopped: out of time
            self.fail(
                out, req, Outcome.EXPIRED, str(result), status=DeadlineExceeded.status, now=now
            )
        elif isinstance(result, Cancelled):  # its call was dropped (workers.runner)
            self.fail(out, req, Outcome.CANCELLED, str(result), status=Cancelled.status, now=now)
        elif isinstance(result, BaseException):
            why = client_message(result)
            logger.warning(
                "stage %s: request %s (trace %s) failed: %s", self.stage, req.id, req.trace_id, why
            )
            self.fail_with(out, req, result, now)
        else:
            self.succeed(out, req, result, now)

    def fail_with(self, out: Outbox, req: Request, exc: BaseException, now: float) -> None:
        """End the request with the error ``exc`` raised while running its step."""
        self.fail(
            out,
            req,
            Outcome.ERROR,
            client_message(exc),
            status=http_status(exc),
            retry_after=exc.retry_after if isinstance(exc, ConveyorError) else None,
            now=now,
        )

    def succeed(self, out: Outbox, req: Request, output: dict[str, Any], now: float) -> None:
        """Hand ``output`` on: to the next steps, a join, or back to the client."""
        pipeline, step = self.locate(req)
        ctx = {**req.state, step.name: output}
        effects = self._effects(out, req, now)
        try:
            nxt = pipeline.after(step, output, ctx)
            if isinstance(nxt, End):
                problem = wire_problem(nxt.response)
                if problem is not None:
                    raise InvalidInput(f"the route's response cannot be sent: {problem.msg}")
                self._reply(effects, req, nxt.response)
            elif not nxt:
                self._reply(effects, req, output)
            else:
                for name in nxt:
                    target = pipeline.step(name)
                    if target.join:
                        self._arrive(effects, req, pipeline, step, target, ctx, now)
                    else:
                        payload = pipeline.input_of(target, ctx, step.name)
                        stream = self.keys.stage_stream(target.stage.name, req.lane)
                        effects.forwards.append((stream, self._next(req, target, payload, ctx)))
            self._bounded(effects, req)
        except BaseException as exc:  # a route or input function (user code) raised
            # anything, SystemExit included: this request ends, the worker serves on
            del out.effects[self.keys.done(req.id, req.step)]
            self.fail_with(out, req, exc, now)

    def _bounded(self, effects: Effects, req: Request) -> None:
        """Raise :class:`InvalidInput` when what ``req``'s step writes (its effects so
        far: one request's) is over :attr:`max_result_bytes` encoded, so none of it is
        written: a result that size would sit in Redis for the job's life (a day) or
        in a reply stream, and a few of them fill its memory or disk."""
        bound = self.max_result_bytes
        size = 0
        for _, reply in effects.replies:
            size += len(orjson.dumps(reply.result)) if reply.result is not None else 0
        for _, forward in effects.forwards:
            size += len(dumps(forward))
        for arrival in effects.joins:
            size += len(arrival.output) + len(arrival.envelope)
        if size <= bound:
            return
        logger.warning(
            "stage %s: request %s (trace %s): its result is %d bytes encoded, over the "
            "bound of %d (CONVEYOR_MAX_RESULT_BYTES); failed, nothing of it written",
            self.stage,
            req.id,
            req.trace_id,
            size,
            bound,
        )
        raise InvalidInput(
            f"the result cannot be sent: it is {size} bytes encoded, over the stage's bound "
            f"of {bound} bytes (CONVEYOR_MAX_RESULT_BYTES)",
            [
                {
                    "loc": ["result"],
                    "msg": f"{size} bytes encoded, over the bound of {bound}",
                    "type": "too_large",
                }
            ],
        )

    def _effects(self, out: Outbox, req: Request, now: float) -> Effects:
        marker = self.keys.done(req.id, req.step)
        if marker not in out.effects:
            ttl_s, cancel_marker = self._ttl(req, now), self.keys.cancelled(req.id)
            out.effects[marker] = Effects(
                marker_ttl_s=ttl_s, cancel_marker=cancel_marker, batched=req.reply_batches
            )
        return out.effects[marker]

    def _reply(self, out: Effects, req: Request, result: dict[str, Any]) -> None:
        reply = Reply(
            id=req.id, stage=self.stage, outcome=Outcome.OK, result=result, trace_id=req.trace_id
        )
        out.replies.append((req.reply_to, reply))

    def _next(
        self, req: Request, step: Step, payload: dict[str, Any], ctx: dict[str, Any]
    ) -> Request:
        # enqueue_by bounds the gateway's own write only; a hand-over is never late. The
        # copy keeps every other field, the lane among them (the next step's stream is
        # the request's lane's).
        update = {
            "stage": step.stage.name,
            "step": step.name,
            "payload": payload,
            "state": ctx,
            "enqueue_by": None,
        }
        return req.model_copy(update=update)

    def _arrive(
        self,
        out: Effects,
        req: Request,
        pipeline: Pipeline,
        branch: Step,
        join: Step,
        ctx: dict[str, Any],
        now: float,
    ) -> None:
        envelope = self._next(req, join, {}, {k: v for k, v in ctx.items() if k not in join.join})
        out.joins.append(
            JoinArrival(
                key=self.keys.join(req.id, join.name),
                stream=self.keys.stage_stream(join.stage.name, req.lane),
                branch=branch.name,
                output=orjson.dumps(ctx[branch.name]),
                expected=len(join.join),
                envelope=dumps(envelope),
                ttl_s=self._ttl(req, now),
            )
        )

    @staticmethod
    def _ttl(req: Request, now: float) -> int:
        # Bounded whatever the envelope says (a foreign writer, a replay): Redis refuses an
        # expiry past its range, and the whole batch's publish with it.
        return min(max(1, int(req.deadline - now)), MAX_DEADLINE_S) + JOIN_GRACE_S
