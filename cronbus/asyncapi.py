"""The contract for every language: ``docs/asyncapi.yaml``, an AsyncAPI 3 document of the command
exchange (one message per verb), the replies, the dead letters and the deliveries of AMQP
targets. Its payload schemas are generated from the models the intake validates with
(``shared.contract.commands``, ``shared.contract.replies``); the envelopes and headers, pinned in
the design, are written here once.

``python -m cronbus.reference`` rewrites the document with the reference pages, and ``--check``
(and the test of the docs) fails when a model changed and it was not regenerated.
"""

from __future__ import annotations

from typing import Any

import yaml
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from shared.contract.commands import COMMAND_MODELS
from shared.contract.replies import StoredSchedule, Triggered

HEADER = (
    "# Generated from the models by `python -m cronbus.reference`: do not edit by hand.\n"
    "# Validated in CI by the AsyncAPI CLI (tools/asyncapi).\n"
)
REF = "#/components/schemas/{model}"

#: The reply's error envelope, pinned in the design (not a model: the intake writes it).
ERROR_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["code", "message", "details"],
    "properties": {
        "code": {
            "type": "string",
            "description": "invalid_schedule, invalid_command, unknown_verb, not_found, "
            "version_conflict, quota_exceeded, conflict, too_large, internal (a newer "
            "cronbus may add codes)",
        },
        "message": {"type": "string"},
        "details": {
            "type": "array",
            "maxItems": 50,
            "items": {
                "type": "object",
                "required": ["field", "reason"],
                "properties": {"field": {"type": "string"}, "reason": {"type": "string"}},
            },
        },
    },
}

DELIVERY_HEADERS: dict[str, Any] = {
    "type": "object",
    "description": "The target's own headers, plus these.",
    "required": ["X-Cronbus-Schedule", "X-Cronbus-Fire-Time", "X-Cronbus-Attempt", "traceparent"],
    "properties": {
        "X-Cronbus-Schedule": {"type": "string", "description": "namespace/id"},
        "X-Cronbus-Fire-Time": {
            "type": "string",
            "format": "date-time",
            "description": "The nominal fire time, RFC 3339 UTC (the trigger time for a trigger).",
        },
        "X-Cronbus-Attempt": {"type": "string", "description": "1, 2, ..."},
        "X-Cronbus-Trigger": {"type": "string", "const": "manual"},
        "X-Cronbus-Backfill": {"type": "string", "const": "true"},
        "traceparent": {"type": "string", "description": "W3C trace context."},
    },
    "additionalProperties": True,
}


def _strip_discriminators(node: Any) -> Any:
    """Pydantic writes OpenAPI's ``discriminator`` object; AsyncAPI's schema keyword of that name
    is a string. The ``oneOf`` of ``const`` kinds says the same, so it is dropped."""
    if isinstance(node, dict):
        return {k: _strip_discriminators(v) for k, v in node.items() if k != "discriminator"}
    if isinstance(node, list):
        return [_strip_discriminators(item) for item in node]
    return node


def model_schemas() -> tuple[dict[str, str], dict[str, Any]]:
    """Each model -> its schema's name, and every schema, from the models themselves."""
    models: list[type[BaseModel]] = sorted(
        {*COMMAND_MODELS.values(), StoredSchedule, Triggered}, key=lambda m: m.__name__
    )
    keys, top = models_json_schema([(model, "validation") for model in models], ref_template=REF)
    names = {
        model.__name__: keys[(model, "validation")]["$ref"].rsplit("/", 1)[1] for model in models
    }
    return names, _strip_discriminators(top.get("$defs", {}))


def _ref(name: str) -> dict[str, str]:
    return {"$ref": REF.format(model=name)}


def _command_message(verb: str, schema: str) -> dict[str, Any]:
    return {
        "name": verb,
        "title": f"{verb} command",
        "summary": f"Published with routing key `<namespace>.{verb}`.",
        "contentType": "application/json",
        "correlationId": {"$ref": "#/components/correlationIds/command"},
        "payload": _ref(schema),
    }


def document() -> dict[str, Any]:
    names, schemas = model_schemas()
    verbs = sorted(COMMAND_MODELS)
    schemas = dict(sorted(schemas.items()))
    schemas["Error"] = ERROR_SCHEMA
    schemas["Reply"] = {
        "description": "Every command with a `reply_to` gets one, with its `correlation_id`. A "
        "newer cronbus may add fields.",
        "oneOf": [
            {
                "type": "object",
                "required": ["ok"],
                "properties": {
                    "ok": {"const": True},
                    "schedule": _ref(names["StoredSchedule"]),
                    "schedules": {"type": "array", "items": _ref(names["StoredSchedule"])},
                    "next_cursor": {"type": ["string", "null"]},
                    "created": {"type": "boolean"},
                    "deleted": {"type": "boolean"},
                    "fire_time": {"type": "string", "format": "date-time"},
                    "idempotency_key": {"type": "string"},
                    "results": {"type": "array", "items": {"type": "object"}},
                    "backfill": {"type": "object"},
                },
            },
            {
                "type": "object",
                "required": ["ok", "error"],
                "properties": {"ok": {"const": False}, "error": _ref("Error")},
            },
        ],
    }
    messages: dict[str, Any] = {
        f"{verb}Command": _command_message(verb, names[COMMAND_MODELS[verb].__name__])
        for verb in verbs
    }
    messages["reply"] = {
        "name": "reply",
        "contentType": "application/json",
        "correlationId": {"$ref": "#/components/correlationIds/command"},
        "payload": _ref("Reply"),
    }
    messages["deadCommand"] = {
        "name": "deadCommand",
        "summary": "A command that ended without a reply, as it was published.",
        "headers": {
            "type": "object",
            "required": ["x-cronbus-error"],
            "properties": {"x-cronbus-error": {"type": "string", "description": "The reason."}},
        },
        "payload": {},
    }
    messages["amqpDelivery"] = {
        "name": "amqpDelivery",
        "summary": "One attempt of an occurrence of a schedule with an amqp target; "
        "`message_id` is the idempotency key (the same on every attempt).",
        "contentType": "application/json",
        "headers": DELIVERY_HEADERS,
        "payload": {"description": "The target's `body`."},
    }
    command_refs = {
        f"{verb}Command": {"$ref": f"#/channels/commands/messages/{verb}Command"} for verb in verbs
    }
    return {
        "asyncapi": "3.0.0",
        "info": {
            "title": "cronbus",
            "version": "1",
            "description": "Schedule commands and their replies over RabbitMQ, the dead letters, "
            "and the deliveries of AMQP targets. See docs/commands.md.",
        },
        "servers": {
            "rabbitmq": {"host": "127.0.0.1:5672", "protocol": "amqp", "protocolVersion": "0.9.1"}
        },
        "defaultContentType": "application/json",
        "channels": {
            "commands": {
                "address": "cronbus.commands",
                "description": "Topic exchange; routing key `<namespace>.<verb>`.",
                "messages": {name: messages[name] for name in command_refs},
                "bindings": {
                    "amqp": {
                        "is": "routingKey",
                        "exchange": {"name": "cronbus.commands", "type": "topic", "durable": True},
                    }
                },
            },
            "replies": {
                "address": "{replyTo}",
                "description": "The command's `reply_to`: `amq.rabbitmq.reply-to` or a queue "
                "exclusive to the sender's connection.",
                "parameters": {"replyTo": {"description": "The command's reply_to."}},
                "messages": {"reply": messages["reply"]},
            },
            "deadCommands": {
                "address": "cronbus.commands.dead",
                "messages": {"deadCommand": messages["deadCommand"]},
                "bindings": {
                    "amqp": {
                        "is": "queue",
                        "queue": {"name": "cronbus.commands.dead", "durable": True},
                    }
                },
            },
            "amqpTarget": {
                "address": "{exchange}",
                "description": "A schedule's amqp target: its exchange and routing key.",
                "parameters": {"exchange": {"description": "target.exchange"}},
                "messages": {"amqpDelivery": messages["amqpDelivery"]},
            },
        },
        "operations": {
            "sendCommand": {
                "action": "send",
                "channel": {"$ref": "#/channels/commands"},
                "messages": list(command_refs.values()),
                "reply": {
                    "address": {"location": "$message.header#/reply_to"},
                    "channel": {"$ref": "#/channels/replies"},
                    "messages": [{"$ref": "#/channels/replies/messages/reply"}],
                },
            },
            "receiveDeadCommand": {
                "action": "receive",
                "channel": {"$ref": "#/channels/deadCommands"},
                "messages": [{"$ref": "#/channels/deadCommands/messages/deadCommand"}],
            },
            "receiveAmqpDelivery": {
                "action": "receive",
                "channel": {"$ref": "#/channels/amqpTarget"},
                "messages": [{"$ref": "#/channels/amqpTarget/messages/amqpDelivery"}],
            },
        },
        "components": {
            "correlationIds": {
                "command": {
                    "description": "The command's correlation_id, repeated on its reply.",
                    "location": "$message.header#/correlation_id",
                }
            },
            "schemas": schemas,
        },
    }


def render() -> str:
    return HEADER + yaml.safe_dump(document(), sort_keys=False, allow_unicode=True, width=100)
