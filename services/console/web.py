"""The console's pages: server-rendered HTML (Jinja2, autoescaped), a little CSS and script.

Reading needs no script; with it, pages refresh themselves every few seconds (the same HTML,
fetched again). Actions (pause, resume, trigger, delete, edit, retry of a dead occurrence, and
pause, resume, trigger or delete of many schedules at once) are POST forms, shown and accepted
only with ``CRONBUS_CONSOLE_ACTIONS=1`` (on by default under ``cronbus dev``); each must carry
the session's CSRF token (a cookie matched by a form field) and come from the same origin.
They are sent as commands over AMQP with the console's own broker user, and name the person
from the auth proxy's ``X-Forwarded-User`` in the command's ``app_id`` (which the command audit
records).
"""

from __future__ import annotations

import datetime as dt
import hashlib
import hmac
import json
import logging
import re
import secrets
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlencode, urlsplit

import aiormq.exceptions
import jinja2
from aiohttp import web

from cronbus.client import Client
from services.console import readmodel, views
from services.console.readmodel import ReadModel
from shared.contract import models
from shared.contract.errors import CronbusError
from shared.rules import compact
from shared.runtime import transient
from shared.runtime.config import ConsoleSettings

log = logging.getLogger(__name__)

HERE = Path(__file__).resolve().parent
CSRF_COOKIE = "cronbus_console_csrf"
USER_HEADER = "X-Forwarded-User"
#: The verbs the console can send, where the contract has them.
ACTION_VERBS = tuple(
    v for v in ("pause", "resume", "trigger", "backfill", "delete") if v in models.VERBS
)
#: The verbs a list page sends for the schedules ticked.
BULK_VERBS = ("pause", "resume", "trigger", "delete")
#: Longest definition the edit form accepts (the intake has its own, larger, limit).
EDIT_MAX_BYTES = 60_000
HISTORY_ROWS = 50
CHART_POINTS = 200
_USER_UNSAFE = re.compile(r"[^A-Za-z0-9@._+-]")

#: What sending an action may run into: shown to the user as "not sent", with the reason.
SEND_ERRORS: tuple[type[BaseException], ...] = (
    *transient.ERRORS,
    aiormq.exceptions.AMQPError,
    CronbusError,
)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def audit_user(header: str | None) -> str:
    """The proxy's user as the audit shows it: a bounded, plain spelling (it goes into an AMQP
    short string and into logs)."""
    text = _USER_UNSAFE.sub("_", (header or "").strip())[:100]
    return text or "anonymous"


def _environment() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(HERE / "templates"),
        autoescape=True,
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters["utc"] = views.utc_text
    env.filters["wait"] = views.duration_text
    env.filters["late"] = views.lateness_text
    env.filters["rate"] = views.rate_text
    env.filters["seg"] = lambda value: quote(str(value), safe="")
    env.globals["query"] = lambda **kw: urlencode({k: v for k, v in kw.items() if v})
    return env


class Console:
    def __init__(
        self,
        settings: ConsoleSettings,
        model: ReadModel,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.settings = settings
        self.model = model
        self.clock = clock
        self.env = _environment()
        self.actions = settings.console_actions

    # --- plumbing -------------------------------------------------------------------------------

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._errors], client_max_size=64 * 1024)
        app.router.add_get("/", self.namespaces)
        app.router.add_get("/failures", self.failures)
        app.router.add_get("/ns/{namespace}", self.schedules)
        app.router.add_get("/ns/{namespace}/s/{id}", self.schedule)
        app.router.add_get("/ns/{namespace}/s/{id}/edit", self.edit_form)
        app.router.add_post("/ns/{namespace}/s/{id}/edit", self.edit)
        app.router.add_post("/ns/{namespace}/s/{id}/retry", self.retry)
        app.router.add_post("/ns/{namespace}/s/{id}/{verb}", self.act)
        app.router.add_post("/ns/{namespace}/bulk", self.bulk)
        app.router.add_static("/static/", HERE / "static", show_index=False)
        return app

    def now(self) -> dt.datetime:
        return dt.datetime.fromtimestamp(self.clock(), dt.UTC)

    def render(
        self, request: web.Request, name: str, status: int = 200, **context: Any
    ) -> web.Response:
        token = request.cookies.get(CSRF_COOKIE) or secrets.token_urlsafe(32)
        context.setdefault("message", _signed_message(request))
        html = self.env.get_template(name).render(
            actions=self.actions,
            action_verbs=ACTION_VERBS,
            bulk_verbs=BULK_VERBS,
            csrf=token,
            user=request.headers.get(USER_HEADER),
            now=self.now(),
            **context,
        )
        response = web.Response(text=html, content_type="text/html", status=status)
        response.headers["Content-Security-Policy"] = (
            "default-src 'none'; style-src 'self'; script-src 'self'; img-src 'self' data:; "
            "connect-src 'self'; "
            "form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
        )
        response.headers["X-Content-Type-Options"] = "nosniff"
        response.headers["Referrer-Policy"] = "same-origin"
        response.headers["Cache-Control"] = "no-store"
        if request.cookies.get(CSRF_COOKIE) != token:
            response.set_cookie(
                CSRF_COOKIE,
                token,
                httponly=True,
                samesite="Strict",
                secure=request.headers.get("X-Forwarded-Proto") == "https",
                path="/",
            )
        return response

    @web.middleware
    async def _errors(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except views.BadQuery as exc:
            return self.render(request, "error.html", 400, title="Bad request", message=str(exc))
        except web.HTTPNotFound:
            return self.render(request, "error.html", 404, title="Not found", message=request.path)
        except transient.ERRORS as exc:
            log.warning(
                "console read failed", extra={"action": "console_read_failed", "error": repr(exc)}
            )
            return self.render(
                request,
                "error.html",
                503,
                title="Unavailable",
                message="PostgreSQL or Redis is not answering; try again shortly.",
            )

    @staticmethod
    def _path_ids(request: web.Request) -> tuple[str, str | None]:
        """Namespace and schedule id from the path; an impossible one is simply not found."""
        namespace = request.match_info["namespace"]
        schedule_id = request.match_info.get("id")
        if not models.NAMESPACE_RE.match(namespace):
            raise web.HTTPNotFound()
        if schedule_id is not None and not models.SCHEDULE_ID_RE.match(schedule_id):
            raise web.HTTPNotFound()
        return namespace, schedule_id

    def _before(self, request: web.Request) -> dt.datetime:
        text = views.check_text("before", request.query.get("before", ""), 40)
        if not text:
            return self.now() + dt.timedelta(days=3650)
        try:
            found = dt.datetime.fromisoformat(text.replace("Z", "+00:00"))
        except ValueError:
            raise views.BadQuery("before", "is not an RFC 3339 time") from None
        if found.tzinfo is None:
            raise views.BadQuery("before", "needs a time zone (Z)")
        try:
            # PostgreSQL takes it in UTC; at the calendar's edges that instant does not exist.
            return found.astimezone(dt.UTC)
        except OverflowError:
            raise views.BadQuery("before", "is outside the years 1 to 9999 in UTC") from None

    # --- pages ----------------------------------------------------------------------------------

    async def namespaces(self, request: web.Request) -> web.Response:
        found = await self.model.namespaces(self.now())
        return self.render(request, "namespaces.html", namespaces=found, states=readmodel.STATES)

    async def schedules(self, request: web.Request) -> web.Response:
        namespace, _ = self._path_ids(request)
        if not await self.model.namespace_known(namespace, self.now()):
            return self.render(
                request,
                "error.html",
                404,
                title="No such namespace",
                message=f"There is no namespace {namespace!r}: no schedule in it (none was "
                "created, or all were deleted) and no deliveries in the last hour. Namespaces "
                "are named when a schedule is created in one.",
            )
        query = request.query
        where = readmodel.ScheduleFilter(
            search=views.check_text("q", query.get("q", "").strip()),
            label=views.parse_label(views.check_text("label", query.get("label", ""), 400)),
            state=views.parse_state(query.get("state", ""), readmodel.STATES),
            after=views.check_text("after", query.get("after", "")),
        )
        rows = await self.model.schedules(namespace, where)
        more = len(rows) > self.model.page_size
        rows = rows[: self.model.page_size]
        return self.render(
            request,
            "schedules.html",
            namespace=namespace,
            rows=rows,
            where=where,
            label_text=query.get("label", ""),
            states=readmodel.STATES,
            next_after=rows[-1].id if more else None,
            now_ms=int(self.clock() * 1000),
        )

    async def schedule(self, request: web.Request) -> web.Response:
        namespace, schedule_id = self._path_ids(request)
        assert schedule_id is not None
        found = await self.model.schedule(namespace, schedule_id)
        if found is None or found.state == "deleted":
            raise web.HTTPNotFound()
        before = self._before(request)
        history = await self.model.executions(namespace, schedule_id, before, CHART_POINTS)
        now_ms = int(self.clock() * 1000)
        plan = compact.decode(found.compact)
        # From the checkpoint's next fire when it lies ahead (as ``get`` shows), else from now.
        checkpoint = (
            None if found.next_fire_at is None else int(found.next_fire_at.timestamp() * 1000)
        )
        start_ms = checkpoint if checkpoint is not None and checkpoint >= now_ms else now_ms
        fires = views.upcoming_fires(plan, start_ms, found.fires) if found.state == "active" else []
        chart = views.lateness_chart(
            [
                views.Point(views.utc_text(e.nominal_at), e.lateness_ms, e.failed)
                for e in reversed(history)
                if not e.is_backfill
            ]
        )
        shown = history[:HISTORY_ROWS]
        return self.render(
            request,
            "schedule.html",
            s=found,
            zone=views.zone_name(plan),
            fires=fires,
            history=shown,
            older=views.utc_text(shown[-1].nominal_at).replace(" ", "T")
            if len(history) > HISTORY_ROWS
            else None,
            chart=chart,
            summary=views.lateness_summary(
                [(e.lateness_ms, e.failed, e.is_backfill) for e in history]
            ),
            commands=await self.model.commands(namespace, schedule_id, 10),
            definition=_pretty(_without_header_values(found.definition)),
            now_ms=now_ms,
        )

    async def failures(self, request: web.Request) -> web.Response:
        namespace = views.check_text("namespace", request.query.get("namespace", "").strip(), 64)
        if namespace and not models.NAMESPACE_RE.match(namespace):
            raise views.BadQuery("namespace", "is not a namespace name")
        rows = await self.model.failures(self._before(request), namespace)
        more = len(rows) > self.model.page_size
        rows = rows[: self.model.page_size]
        return self.render(
            request,
            "failures.html",
            rows=rows,
            namespace=namespace,
            namespaces=[n.namespace for n in await self.model.namespaces(self.now())],
            older=rows[-1].finished_at.astimezone(dt.UTC).isoformat().replace("+00:00", "Z")
            if more
            else None,
        )

    # --- actions --------------------------------------------------------------------------------

    def _check_csrf(self, request: web.Request, form: dict[str, str]) -> None:
        cookie = request.cookies.get(CSRF_COOKIE, "")
        sent = form.get("csrf", "")
        if not cookie or not hmac.compare_digest(cookie.encode(), sent.encode()):
            raise web.HTTPForbidden(text="missing or stale form token: reload the page")
        site = request.headers.get("Sec-Fetch-Site")
        if site is not None and site not in ("same-origin", "none"):
            raise web.HTTPForbidden(text="cross-site request refused")
        origin = request.headers.get("Origin")
        if origin is not None and urlsplit(origin).netloc != request.host:
            raise web.HTTPForbidden(text="cross-origin request refused")

    async def _form(self, request: web.Request) -> dict[str, str]:
        if not self.actions:
            raise web.HTTPNotFound()
        form = {k: str(v) for k, v in (await request.post()).items()}
        self._check_csrf(request, form)
        return form

    def _done(self, request: web.Request, target: str, message: str) -> web.HTTPSeeOther:
        signature = _sign(request.cookies.get(CSRF_COOKIE, ""), message)
        return web.HTTPSeeOther(f"{target}?{urlencode({'message': message, 'sig': signature})}")

    async def act(self, request: web.Request) -> web.StreamResponse:
        namespace, schedule_id = self._path_ids(request)
        assert schedule_id is not None
        verb = request.match_info["verb"]
        if verb not in ACTION_VERBS:
            raise web.HTTPNotFound()
        form = await self._form(request)
        body: dict[str, Any] = {"id": schedule_id}
        if verb == "backfill":
            body.update({"from": form.get("from", ""), "to": form.get("to", "")})
        (message,) = await self._send(request, namespace, [(verb, body)])
        target = _schedule_path(namespace, schedule_id)
        if verb == "delete" and message.endswith(": done"):
            target = f"/ns/{quote(namespace, safe='')}"
            message = f"{schedule_id} deleted"
        raise self._done(request, target, message)

    async def retry(self, request: web.Request) -> web.StreamResponse:
        """A dead occurrence delivered again: a backfill of its one nominal time, which carries
        the occurrence's own idempotency key (the target can tell it is the same one)."""
        namespace, schedule_id = self._path_ids(request)
        assert schedule_id is not None
        form = await self._form(request)
        try:
            start = dt.datetime.fromisoformat(form.get("nominal", "").replace("Z", "+00:00"))
        except ValueError:
            raise views.BadQuery("nominal", "is not an RFC 3339 time") from None
        if start.tzinfo is None:
            raise views.BadQuery("nominal", "needs a time zone (Z)")
        end = start + dt.timedelta(milliseconds=1)
        body = {"id": schedule_id, "from": _rfc3339(start), "to": _rfc3339(end), "limit": 1}
        (message,) = await self._send(request, namespace, [("backfill", body)])
        message = message.replace("backfill", f"retry of {_rfc3339(start)}", 1)
        raise self._done(request, _schedule_path(namespace, schedule_id), message)

    async def bulk(self, request: web.Request) -> web.StreamResponse:
        namespace, _ = self._path_ids(request)
        form = await self._form(request)
        verb = form.get("verb", "")
        # Ticked boxes share the name "id" (post() is read once and kept by aiohttp).
        ids = [str(v) for v in (await request.post()).getall("id", [])]
        if verb not in BULK_VERBS or not ids or len(ids) > self.model.page_size:
            raise views.BadQuery("id", "tick one schedule or more, and an action")
        if not all(models.SCHEDULE_ID_RE.match(i) for i in ids):
            raise views.BadQuery("id", "is not a schedule id")
        results = await self._send(request, namespace, [(verb, {"id": i}) for i in ids])
        done = sum(1 for r in results if r.endswith(": done"))
        problems = sorted({r for r in results if not r.endswith(": done")})
        message = f"{verb}: {done} of {len(ids)} done" + (
            f"; {'; '.join(problems)}" if problems else ""
        )
        raise self._done(request, f"/ns/{quote(namespace, safe='')}", message)

    async def edit_form(self, request: web.Request) -> web.Response:
        if not self.actions:
            raise web.HTTPNotFound()
        namespace, schedule_id = self._path_ids(request)
        assert schedule_id is not None
        found = await self.model.schedule(namespace, schedule_id)
        if found is None or found.state == "deleted":
            raise web.HTTPNotFound()
        text = _pretty(_without_header_values(_editable(found.definition)))
        return self.render(request, "edit.html", s=found, text=text, problems=[])

    async def edit(self, request: web.Request) -> web.StreamResponse:
        """An upsert of the edited definition at the version the form was made from."""
        namespace, schedule_id = self._path_ids(request)
        assert schedule_id is not None
        form = await self._form(request)
        found = await self.model.schedule(namespace, schedule_id)
        if found is None or found.state == "deleted":
            raise web.HTTPNotFound()
        text = form.get("definition", "")
        try:
            if len(text.encode()) > EDIT_MAX_BYTES:
                raise ValueError(f"is longer than {EDIT_MAX_BYTES} bytes")
            edited = json.loads(text)
            if not isinstance(edited, dict):
                raise ValueError("must be a JSON object")
            version = int(form.get("version", ""))
        except ValueError as exc:
            return self.render(
                request, "edit.html", 400, s=found, text=text, problems=[f"definition: {exc}"]
            )
        try:
            schedule = _with_header_values({**edited, "id": schedule_id}, found.definition)
        except ValueError as exc:
            return self.render(request, "edit.html", 400, s=found, text=text, problems=[str(exc)])
        body = {"schedule": schedule, "expected_version": version}
        (message,) = await self._send(request, namespace, [("upsert", body)])
        if not message.endswith(": done"):
            return self.render(request, "edit.html", 409, s=found, text=text, problems=[message])
        raise self._done(request, _schedule_path(namespace, schedule_id), "saved")

    async def _send(
        self, request: web.Request, namespace: str, commands: list[tuple[str, dict[str, Any]]]
    ) -> list[str]:
        """Each command sent over AMQP on one connection; per command what came of it."""
        url = self.settings.actions_amqp_url()
        user = audit_user(request.headers.get(USER_HEADER))
        log.info(
            "console action",
            extra={
                "action": "console_action",
                "verbs": sorted({verb for verb, _ in commands}),
                "commands": len(commands),
                "namespace": namespace,
                "user": user,
            },
        )
        results: list[str] = []
        try:
            # The client sends user_id as the URL's broker user, which RabbitMQ checks.
            async with Client(url, timeout_s=10, app_id="cronbus-console") as client:
                for verb, body in commands:
                    reply = await client.send(
                        namespace,
                        verb,
                        body,
                        app_id=f"cronbus-console:{user}",
                        headers={"x-cronbus-on-behalf-of": user},
                    )
                    results.append(_outcome(verb, reply))
        except SEND_ERRORS as exc:
            results += [f"{verb} not sent: {exc!r}" for verb, _ in commands[len(results) :]]
        return results


def _outcome(verb: str, reply: dict[str, Any]) -> str:
    if reply.get("ok"):
        return f"{verb}: done"
    error = reply.get("error") or {}
    details = "; ".join(
        f"{d.get('field')}: {d.get('reason')}" for d in error.get("details") or [] if d
    )
    return f"{verb} refused: {error.get('code')}: {details or error.get('message')}"


def _schedule_path(namespace: str, schedule_id: str) -> str:
    return f"/ns/{quote(namespace, safe='')}/s/{quote(schedule_id, safe='')}"


def _rfc3339(at: dt.datetime) -> str:
    return at.astimezone(dt.UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _editable(definition: dict[str, Any]) -> dict[str, Any]:
    """The definition as an upsert takes it: ``paused`` is the state (pause and resume set it)
    and stays as it is; the id is the page's."""
    return {k: v for k, v in definition.items() if k != "id"}


#: What a target's hidden header values are sent to: they go back in only while it stays put.
_DESTINATION = ("kind", "url", "method", "exchange", "routing_key")


def _with_header_values(edited: dict[str, Any], stored: dict[str, Any]) -> dict[str, Any]:
    """Header values the form showed as hidden take their stored values back, but only while
    the target still sends them where it did: the person editing never saw those values (they
    are tenants' credentials), so they may not redirect them. ValueError names the header."""
    target, old = edited.get("target"), stored.get("target")
    if not isinstance(target, dict) or not isinstance(old, dict):
        return edited
    headers, old_headers = target.get("headers"), old.get("headers")
    if not isinstance(headers, dict) or not isinstance(old_headers, dict):
        return edited
    hidden = [k for k, v in headers.items() if v == HIDDEN and k in old_headers]
    moved = [f for f in _DESTINATION if target.get(f) != old.get(f)]
    if hidden and moved:
        raise ValueError(
            f"target.headers.{hidden[0]}: its value is hidden and the target's "
            f"{', '.join(moved)} changed: type the value again to send it to the new target"
        )
    restored = {k: (old_headers[k] if k in hidden else v) for k, v in headers.items()}
    return {**edited, "target": {**target, "headers": restored}}


def _sign(token: str, message: str) -> str:
    return hmac.new(token.encode(), message.encode(), hashlib.sha256).hexdigest()[:32]


def _signed_message(request: web.Request) -> str:
    """The outcome of this session's own action; a crafted link's text is not shown."""
    message = request.query.get("message", "")
    token = request.cookies.get(CSRF_COOKIE, "")
    if not message or not token:
        return ""
    if not hmac.compare_digest(_sign(token, message), request.query.get("sig", "")):
        return ""
    return message[:500]


#: What the definition view shows instead of a header's value.
HIDDEN = "(hidden)"


def _without_header_values(definition: Any) -> Any:
    """The definition with its target's header values hidden: headers are where tenants put
    credentials (URLs may not carry them), and the console shows every namespace."""
    if not isinstance(definition, dict) or not isinstance(definition.get("target"), dict):
        return definition
    target = definition["target"]
    if not isinstance(target.get("headers"), dict):
        return definition
    hidden = dict.fromkeys(target["headers"], HIDDEN)
    return {**definition, "target": {**target, "headers": hidden}}


def _pretty(value: Any) -> str:
    return json.dumps(value, indent=2, ensure_ascii=False, sort_keys=True)
